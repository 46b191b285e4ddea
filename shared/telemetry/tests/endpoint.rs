//! The /metrics endpoint over HTTP: what is recorded through the `metrics` facade, gauges set
//! by a collector at scrape time, histograms with buckets, and nothing served elsewhere.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nibble_telemetry::{Collect, CollectFuture, Samples};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Queue(AtomicU64);

impl Collect for Queue {
    fn collect(&self) -> CollectFuture<'_> {
        Box::pin(async move {
            metrics::gauge!("test_queue_length").set(self.0.load(Ordering::Relaxed) as f64);
        })
    }
}

#[tokio::test]
async fn serves_counters_collected_gauges_and_histograms() {
    let listener = nibble_telemetry::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let server = nibble_telemetry::spawn(listener).unwrap();
    assert!(nibble_telemetry::installed().unwrap().is_global());

    metrics::describe_counter!("test_requests_total", "Requests.");
    metrics::counter!("test_requests_total", "outcome" => "finished").increment(2);
    metrics::histogram!("test_latency_seconds").record(Duration::from_millis(30));
    let queue = Arc::new(Queue(AtomicU64::new(5)));
    nibble_telemetry::register(&queue);

    let text = nibble_telemetry::scrape(server.address()).await.unwrap();
    assert!(
        text.contains("# HELP test_requests_total Requests."),
        "{text}"
    );
    let samples = Samples::parse(&text);
    assert_eq!(
        samples.value("test_requests_total", &[("outcome", "finished")]),
        2.0
    );
    assert_eq!(samples.value("test_queue_length", &[]), 5.0);
    assert_eq!(samples.value("test_latency_seconds_count", &[]), 1.0);
    assert_eq!(
        samples.value("test_latency_seconds_bucket", &[("le", "0.05")]),
        1.0
    );
    assert_eq!(
        samples.value("test_latency_seconds_bucket", &[("le", "0.025")]),
        0.0
    );

    // A gauge follows its source at each scrape; a dropped collector is no longer asked.
    queue.0.store(7, Ordering::Relaxed);
    let samples = Samples::parse(&nibble_telemetry::scrape(server.address()).await.unwrap());
    assert_eq!(samples.value("test_queue_length", &[]), 7.0);
    drop(queue);
    let samples = Samples::parse(&nibble_telemetry::scrape(server.address()).await.unwrap());
    assert_eq!(samples.value("test_queue_length", &[]), 7.0);

    // Only /metrics is served.
    let mut stream = tokio::net::TcpStream::connect(server.address())
        .await
        .unwrap();
    stream
        .write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.0 404"), "{response}");
}

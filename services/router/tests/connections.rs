//! The HTTP API's connection limits against the clients of issue 18, on the real router served
//! on loopback: headers trickled a byte at a time, a body declared and never sent (or trickled),
//! connections that send nothing, over plain TCP and after a TLS handshake, and more idle
//! connections than the cap. Each must be closed within its deadline (or make room for a new
//! connection) while a normal request on another connection still gets its answer.

mod support;

use std::time::{Duration, Instant};

use nibble_discovery::{Role, StaticRegistry};
use nibble_kvfmt::KvDtype;
use nibble_router::http::limits::ConnectionLimits;
use nibble_router::HttpConfig;
use nibble_security::testing::TestPki;
use nibble_testkit::http_client::{get, post_json, HttpResponse};
use nibble_testkit::{generate, RouterApi};
use serde_json::json;
use support::{greedy_request, prompt, RouterServer, Worker, MODEL, NEW_TOKENS, PROMPT};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Deadlines short enough for a test, the idle timeout far beyond them: what closes the slow
/// clients below is their own deadline, not silence.
fn limits(max_connections: usize) -> ConnectionLimits {
    ConnectionLimits {
        max_connections,
        idle_timeout: Duration::from_secs(30),
        header_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
    }
}

async fn router(registry: &StaticRegistry, limits: ConnectionLimits) -> RouterServer {
    let http = HttpConfig {
        limits,
        ..HttpConfig::default()
    };
    RouterServer::start(registry, 16, http, |_| {}).await
}

/// Sends `head`, then one more byte of `trickle` every 200 ms, reading meanwhile; returns what
/// the server sent and how long after the first byte it closed the connection (`None`: still
/// open after `give_up`).
async fn trickle<S: AsyncRead + AsyncWrite + Unpin>(
    mut conn: S,
    head: &[u8],
    trickle: &[u8],
    give_up: Duration,
) -> (String, Option<Duration>) {
    let start = Instant::now();
    conn.write_all(head).await.unwrap();
    let mut said = Vec::new();
    let mut bytes = trickle.iter().cycle();
    while start.elapsed() < give_up {
        let mut buf = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(200), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (text(&said), Some(start.elapsed())),
            Ok(Ok(n)) => said.extend_from_slice(&buf[..n]),
            Err(_) => {
                let byte = [*bytes.next().unwrap()];
                if conn.write_all(&byte).await.is_err() {
                    return (text(&said), Some(start.elapsed()));
                }
            }
        }
    }
    (text(&said), None)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

const SLOW_HEADERS: &[u8] = b"POST /tokenize HTTP/1.1\r\nHost: x\r\n";
/// A body declared, of which only the start is ever sent.
const UNSENT_BODY: &[u8] =
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro";

/// What a normal client gets meanwhile: `/health`, and a `POST` whose body is read and parsed.
async fn normal_requests_answer(http: &str) {
    assert_eq!(get(http, "/health").await.status, 200);
    let tokenized = post_json(http, "/tokenize", &json!({"prompt": "Hello"})).await;
    assert_eq!(tokenized.status, 200, "{}", tokenized.text());
    assert!(tokenized.json()["count"].as_u64().unwrap() > 0);
}

/// Closed within the 1 s deadline (with room for a loaded machine), far before the 30 s idle
/// timeout.
fn within_deadline(closed: Option<Duration>, what: &str) {
    let closed = closed.unwrap_or_else(|| panic!("{what}: still open after 8 s"));
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_secs(5),
        "{what}: closed after {closed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_and_unsent_bodies_are_closed_within_their_deadlines() {
    let registry = StaticRegistry::new();
    let router = router(&registry, limits(64)).await;
    let http = router.http_address().to_string();
    let connect = || TcpStream::connect(http.clone());
    let give_up = Duration::from_secs(8);

    let (slow_headers, unsent, slow_body, _) = tokio::join!(
        // A header byte every 200 ms: never idle, but its headers never end.
        async { trickle(connect().await.unwrap(), SLOW_HEADERS, b"X", give_up).await },
        // A body declared and never sent.
        async {
            let mut conn = connect().await.unwrap();
            conn.write_all(UNSENT_BODY).await.unwrap();
            let start = Instant::now();
            let mut said = Vec::new();
            let read = tokio::time::timeout(give_up, conn.read_to_end(&mut said)).await;
            (text(&said), read.ok().map(|_| start.elapsed()))
        },
        // A body trickled a byte every 200 ms.
        async { trickle(connect().await.unwrap(), UNSENT_BODY, b" ", give_up).await },
        // Meanwhile, normal requests are answered.
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            normal_requests_answer(&http).await
        },
    );
    let (said, closed) = slow_headers;
    within_deadline(closed, "trickled headers");
    assert!(said.is_empty(), "closed without an answer: {said}");
    for (what, (said, closed)) in [("unsent body", unsent), ("trickled body", slow_body)] {
        within_deadline(closed, what);
        assert!(said.starts_with("HTTP/1.1 408"), "{what}: {said}");
        assert!(
            said.to_lowercase().contains("connection: close"),
            "{what}: {said}"
        );
        assert!(
            said.contains("the request body did not arrive within 1 s of its headers"),
            "{what}: {said}"
        );
    }
    normal_requests_answer(&http).await;
}

/// The same deadlines hold after a TLS handshake: what is timed is the decrypted request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadlines_hold_over_tls() {
    use tokio_rustls::rustls;
    let pki = TestPki::new("nibble test CA");
    let node = pki.issue("node", &["127.0.0.1"]);
    let security = pki.security(&node, None).load().unwrap();
    let registry = StaticRegistry::new();
    let http = HttpConfig {
        limits: limits(64),
        ..HttpConfig::default()
    };
    let router =
        RouterServer::start(&registry, 16, http, move |c| c.security = security.clone()).await;
    let connector = nibble_testkit::tls::connector(&pki.ca).unwrap();
    let address = router.http_address().to_string();
    let connect = || async {
        let tcp = TcpStream::connect(&address).await.unwrap();
        let name = rustls::pki_types::ServerName::IpAddress(
            address.parse::<std::net::SocketAddr>().unwrap().ip().into(),
        );
        connector.connect(name, tcp).await.unwrap()
    };
    let give_up = Duration::from_secs(8);
    let (slow_headers, slow_body) = tokio::join!(
        async { trickle(connect().await, SLOW_HEADERS, b"X", give_up).await },
        async { trickle(connect().await, UNSENT_BODY, b" ", give_up).await },
    );
    within_deadline(slow_headers.1, "trickled headers over TLS");
    within_deadline(slow_body.1, "trickled body over TLS");
    assert!(slow_body.0.starts_with("HTTP/1.1 408"), "{}", slow_body.0);
}

/// A connection that sends nothing is closed after the idle timeout; one whose request is being
/// answered is not idle, however long its answer takes to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_idle_timeout() {
    let registry = StaticRegistry::new();
    let router = router(
        &registry,
        ConnectionLimits {
            idle_timeout: Duration::from_secs(1),
            ..limits(64)
        },
    )
    .await;
    let mut silent = TcpStream::connect(router.http_address()).await.unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(8), silent.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    let closed = start.elapsed();
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_secs(5),
        "closed after {closed:?}"
    );
}

/// More idle and half-sent connections than the cap: each new connection closes the one silent
/// longest, so `/health` and a real completion are answered at once, and only when every
/// connection under the cap is being answered is a new one refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_cap_make_room_for_health_and_requests() {
    let registry = StaticRegistry::new();
    let decode = Worker::start(&registry, Role::Decode, "d0", KvDtype::Nvfp4).await;
    let page_size = decode.state.engine().info().page_size as u32;
    let http = HttpConfig {
        limits: ConnectionLimits {
            header_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_connections: 64,
        },
        ..HttpConfig::default()
    };
    let router = RouterServer::start(&registry, page_size, http, |_| {}).await;
    router.wait_for_workers(0, 1).await;
    let address = router.http_address().to_string();

    // 200 connections: half send nothing, half begin a request's headers.
    let mut held = Vec::new();
    for i in 0..200 {
        let mut conn = TcpStream::connect(&address).await.unwrap();
        if i % 2 == 1 {
            conn.write_all(SLOW_HEADERS).await.unwrap();
        }
        held.push(conn);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let start = Instant::now();
    let health = get(&address, "/health").await;
    assert_eq!(health.status, 200, "{}", health.text());
    let health_took = start.elapsed();
    assert!(
        health_took < Duration::from_secs(2),
        "/health took {health_took:?}"
    );
    let completion = post_json(
        &address,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}),
    )
    .await;
    assert_eq!(completion.status, 200, "{}", completion.text());
    assert_eq!(completion.json()["usage"]["completion_tokens"], NEW_TOKENS);
    assert_eq!(completion.json()["usage"]["prompt_tokens"], prompt().len());
    // The gRPC API does not share the HTTP cap.
    let mut client = router.client().await;
    let grpc = generate(&mut client, greedy_request("past-the-cap"))
        .await
        .unwrap();
    assert_eq!(grpc.tokens.len(), NEW_TOKENS as usize);

    // Connections were closed to make room, the least recently active first: the cap holds,
    // every one of the first hundred is gone, and the ones left are recent.
    let mut open = Vec::new();
    for (i, conn) in held.iter_mut().enumerate() {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(20), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            Ok(Ok(n)) => panic!("an idle connection was answered: {}", text(&buf[..n])),
            Err(_) => open.push(i),
        }
    }
    assert!(
        (60..=64).contains(&open.len()),
        "{} of 200 still open: {open:?}",
        open.len()
    );
    assert!(open.iter().all(|&i| i >= 100), "old ones kept: {open:?}");
    drop(held);

    // A router whose cap of 2 is filled by streams being answered refuses a third connection.
    let small = HttpConfig {
        limits: ConnectionLimits {
            max_connections: 2,
            ..limits(2)
        },
        ..HttpConfig::default()
    };
    let busy = RouterServer::start(&registry, page_size, small, |_| {}).await;
    busy.wait_for_workers(0, 1).await;
    let refused = refused_when_all_are_answered(busy.http_address(), 2).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("too many open connections"));
}

/// Fills a cap of `cap` with requests being answered (bodies arrived, streams open), then opens
/// one more connection: its answer.
async fn refused_when_all_are_answered(address: &str, cap: usize) -> HttpResponse {
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
                      "temperature": 0, "stream": true, "ignore_eos": true})
    .to_string();
    let mut streams = Vec::new();
    for _ in 0..cap {
        let mut conn = nibble_testkit::http_client::send(
            address,
            "POST",
            "/v1/completions",
            &[],
            Some(body.as_bytes()),
        )
        .await;
        // Wait for the stream's head: the request is being answered.
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(60), conn.read(&mut buf))
            .await
            .expect("a stream's head")
            .unwrap();
        assert!(
            text(&buf[..n]).starts_with("HTTP/1.1 "),
            "{}",
            text(&buf[..n])
        );
        streams.push(conn);
    }
    let mut extra = TcpStream::connect(address).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), extra.read_to_end(&mut raw))
        .await
        .expect("a refusal, not a wait")
        .unwrap();
    nibble_testkit::http_client::parse(&raw)
}

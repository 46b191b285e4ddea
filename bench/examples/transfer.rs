//! Page-transfer throughput of the gRPC backend over loopback.
//!
//!     cargo run --release -p nibble-bench --example transfer [-- PROMPT_TOKENS ITERATIONS]
//!
//! For each KV dtype: a prefill worker P and a decode worker D (real gRPC servers on loopback
//! ports). Each iteration D reserves pages for the whole prompt, P prefills it (from its prefix
//! cache after the first iteration, so only the last token is computed) and pushes every page,
//! data and scales, to D's KvTransfer; then the reservation is aborted so the next one needs
//! every page again. P reports each push's pages, bytes and time (export from P's pool, the
//! gRPC stream, import into D's pool); the throughput is bytes over that time.

use nibble_bench::cluster::{quantile, text_tokens, LocalCluster, Setup};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::worker_client::WorkerClient;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let prompt_tokens: usize = args
        .next()
        .map_or(4096, |a| a.parse().expect("PROMPT_TOKENS"));
    let iterations: usize = args.next().map_or(20, |a| a.parse().expect("ITERATIONS"));
    let prompt = text_tokens(prompt_tokens);
    println!(
        "| KV dtype | pages | MB per push | median GB/s | p10 GB/s | p90 GB/s | pushes |\n\
         | --- | --- | --- | --- | --- | --- | --- |"
    );
    for dtype in KvDtype::ALL {
        let cluster = LocalCluster::start(&Setup {
            kv_dtype: dtype,
            kv_budget_mib: 512,
            threads: 2,
            local_prefill_threshold: 0,
        })
        .await;
        let connect = |a: &str| {
            let uri = format!("http://{a}");
            async move {
                WorkerClient::connect(uri)
                    .await
                    .expect("connect")
                    .max_decoding_message_size(64 << 20)
            }
        };
        let (mut p, mut d) = (
            connect(&cluster.prefill).await,
            connect(&cluster.decode).await,
        );
        let info = d.info(v1::InfoRequest {}).await.expect("Info").into_inner();
        let mut rates = Vec::new();
        let mut pushed = (0, 0);
        for i in 0..=iterations {
            let request_id = format!("transfer-{dtype}-{i}");
            let reservation = d
                .reserve(v1::ReserveRequest {
                    request_id: request_id.clone(),
                    token_ids: prompt.clone(),
                    kv_format_fingerprint: info.kv_format_fingerprint,
                    ttl_ms: None,
                    max_tokens: Some(1),
                })
                .await
                .expect("Reserve")
                .into_inner();
            assert_eq!(
                reservation.first_page_index, 0,
                "D must lack the whole prompt (it kept pages of an aborted reservation)"
            );
            let prefilled = p
                .prefill(v1::PrefillRequest {
                    request_id: request_id.clone(),
                    token_ids: prompt.clone(),
                    sampling: Some(v1::SamplingParams {
                        temperature: Some(0.0),
                        ..Default::default()
                    }),
                    logprobs: None,
                    target: Some(v1::TransferTarget {
                        address: info.transfer_address.clone(),
                        reservation_id: reservation.reservation_id,
                        first_page_index: reservation.first_page_index,
                        page_count: reservation.page_count,
                        page_ids: reservation.page_ids.clone(),
                        kv_format_fingerprint: reservation.kv_format_fingerprint,
                        backend: v1::TransferBackend::Grpc as i32,
                        decode_worker_id: String::new(),
                    }),
                })
                .await
                .expect("Prefill")
                .into_inner();
            d.abort(v1::AbortRequest { request_id })
                .await
                .expect("Abort");
            let transfer = prefilled.transfer.expect("a transfer summary");
            if i == 0 {
                continue; // warm-up: the prefill computed the whole prompt
            }
            pushed = (transfer.pages, transfer.bytes);
            rates.push(transfer.bytes as f64 / (transfer.duration_us as f64 * 1e-6) / 1e9);
        }
        let n = rates.len();
        println!(
            "| {dtype} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {n} |",
            pushed.0,
            pushed.1 as f64 / 1e6,
            quantile(&mut rates, 0.5),
            quantile(&mut rates, 0.1),
            quantile(&mut rates, 0.9),
        );
    }
}

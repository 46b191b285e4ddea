//! The generated servers and clients talk to each other over a real loopback socket, next to the
//! health and reflection services every nibble server runs.

use std::net::SocketAddr;

use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_proto::v1::kv_transfer_server::{KvTransfer, KvTransferServer};
use nibble_proto::v1::{self, PushPagesRequest, PushPagesResponse};
use nibble_testkit::reflection::{expected_services, reflect, Version};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const PAGE_BYTES: usize = 64;
const FINGERPRINT: u64 = 0xfeed_f00d;

/// Accepts pages of PAGE_BYTES for reservation 7 and counts them.
struct Sink;

#[tonic::async_trait]
impl KvTransfer for Sink {
    async fn push_pages(
        &self,
        request: Request<Streaming<PushPagesRequest>>,
    ) -> Result<Response<PushPagesResponse>, Status> {
        let mut stream = request.into_inner();
        let mut summary = PushPagesResponse::default();
        let mut first = true;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            if first {
                if chunk.kv_format_fingerprint != Some(FINGERPRINT) {
                    return Err(Status::failed_precondition("KV format fingerprints differ"));
                }
                first = false;
            }
            if chunk.reservation_id != 7 {
                return Err(Status::not_found("no such reservation"));
            }
            if chunk.data.len() != chunk.page_indices.len() * PAGE_BYTES {
                return Err(Status::invalid_argument("data length"));
            }
            summary.pages += chunk.page_indices.len() as u32;
            summary.bytes += chunk.data.len() as u64;
        }
        summary.complete = summary.pages == 3;
        Ok(Response::new(summary))
    }

    async fn nccl_connect(
        &self,
        _: Request<v1::NcclConnectRequest>,
    ) -> Result<Response<v1::NcclConnectResponse>, Status> {
        Err(Status::failed_precondition("no NCCL here"))
    }

    type NcclPagesStream = tokio_stream::Empty<Result<v1::NcclPagesProgress, Status>>;

    async fn nccl_pages(
        &self,
        _: Request<v1::NcclPagesRequest>,
    ) -> Result<Response<Self::NcclPagesStream>, Status> {
        Err(Status::failed_precondition("no NCCL here"))
    }
}

async fn serve() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (reporter, health) = nibble_proto::serving::health();
    reporter.set_serving::<KvTransferServer<Sink>>().await;
    let reflection = nibble_proto::serving::reflection(&["nibble.v1.KvTransfer"]).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvTransferServer::new(Sink))
            .add_service(health)
            .add_service(reflection.v1)
            .add_service(reflection.v1alpha)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    addr
}

fn chunk(fingerprint: Option<u64>, pages: &[u32]) -> PushPagesRequest {
    PushPagesRequest {
        reservation_id: 7,
        page_indices: pages.to_vec(),
        data: vec![0xab; pages.len() * PAGE_BYTES].into(),
        kv_format_fingerprint: fingerprint,
        request_id: "r1".into(),
    }
}

#[tokio::test]
async fn push_pages_streams_to_the_server() {
    let addr = serve().await;
    let mut client = KvTransferClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let chunks = vec![chunk(Some(FINGERPRINT), &[2, 3]), chunk(None, &[4])];
    let summary = client
        .push_pages(tokio_stream::iter(chunks))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        summary,
        PushPagesResponse {
            pages: 3,
            bytes: 3 * PAGE_BYTES as u64,
            complete: true
        }
    );

    let refused = client
        .push_pages(tokio_stream::iter(vec![chunk(Some(1), &[2])]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let addr = serve().await;
    let url = format!("http://{addr}");

    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "nibble.v1.KvTransfer"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::Serving, "{service:?}");
    }

    // Both versions list what the server runs, and only that, and describe its symbols.
    for version in Version::ALL {
        let reflected = reflect(channel.clone(), version, "nibble.v1.KvTransfer")
            .await
            .unwrap();
        assert_eq!(
            reflected.services,
            expected_services(&["nibble.v1.KvTransfer"]),
            "{version:?}"
        );
        assert!(reflected.symbol_files > 0, "{version:?}: {reflected:?}");
        // Every nibble.v1 message is described, also of services this server does not run.
        let other = reflect(channel.clone(), version, "nibble.v1.GenerateRequest")
            .await
            .unwrap();
        assert!(other.symbol_files > 0, "{version:?}: {other:?}");
    }
}

/// Past a server's connection cap a new connection is closed as it arrives (the client sees the
/// connection close: CANCELLED or UNAVAILABLE); once a held one closes, connections are taken
/// again.
#[tokio::test]
async fn connections_past_the_cap_are_refused() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = nibble_proto::serving::health();
    tokio::spawn(
        nibble_proto::serving::server()
            .add_service(health)
            .serve_with_incoming(nibble_proto::serving::incoming(listener, 1)),
    );
    let check = |channel: tonic::transport::Channel| async move {
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
    };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap();
    let held = endpoint.connect().await.unwrap();
    check(held.clone())
        .await
        .expect("the first connection is served");
    let refused = endpoint
        .clone()
        .connect_timeout(std::time::Duration::from_secs(2))
        .connect_lazy();
    let status = check(refused).await.unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    drop(held);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let again = endpoint.connect().await.unwrap();
    check(again)
        .await
        .expect("served again once the held one closed");
}

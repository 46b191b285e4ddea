//! The NCCL transfer protocol on the CPU: prefill and decode workers as in-process gRPC servers
//! whose device links are `MemoryLinks` (the in-process twin of NCCL), with unique ids exchanged
//! through the in-process registry or a real etcd. What NCCL itself does on GPUs is checked by
//! `nibble-nccl`'s `nccl_check` example on the GPU machine.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nibble_discovery::{
    Capacity, Discovery, EtcdConfig, EtcdDiscovery, KvKey, NcclEndpoint, Role, StaticRegistry,
    WorkerId, WorkerInfo, WorkerWatch,
};
use nibble_kvfmt::KvDtype;
use nibble_nccl::link::{Link, LinkFactory, MemoryLinks, Staging};
use nibble_proto::v1;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_testkit::{handoff_over, model, EtcdServer, Handoff, WorkerApi};
use nibble_worker::transfer::nccl::{NcclTimeouts, NcclTransport};
use support::{engine, Server, PAGES};
use tonic::Code;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife.";

fn prompt() -> Vec<u32> {
    model().1.encode(PROMPT, false).unwrap()
}

fn stopping() -> v1::StoppingCriteria {
    v1::StoppingCriteria {
        max_tokens: Some(4),
        ..Default::default()
    }
}

async fn server(role: v1::WorkerRole, id: &str) -> Server {
    Server::start(engine(KvDtype::Nvfp4), role, id.into()).await
}

/// Every key a session put and deleted, in order.
#[derive(Default)]
struct Log {
    puts: Vec<String>,
    deletes: Vec<String>,
}

/// A discovery session that records its key-value writes.
struct Recording {
    inner: Arc<dyn Discovery>,
    log: Arc<Mutex<Log>>,
}

#[async_trait]
impl Discovery for Recording {
    async fn register(&self, w: WorkerInfo) -> nibble_discovery::Result<()> {
        self.inner.register(w).await
    }
    async fn update_capacity(
        &self,
        role: Role,
        id: &WorkerId,
        c: Capacity,
    ) -> nibble_discovery::Result<()> {
        self.inner.update_capacity(role, id, c).await
    }
    async fn deregister(&self, role: Role, id: &WorkerId) -> nibble_discovery::Result<()> {
        self.inner.deregister(role, id).await
    }
    async fn list(&self, role: Option<Role>) -> nibble_discovery::Result<Vec<WorkerInfo>> {
        self.inner.list(role).await
    }
    async fn watch(&self, role: Option<Role>) -> nibble_discovery::Result<WorkerWatch> {
        self.inner.watch(role).await
    }
    async fn put(&self, key: &KvKey, value: Vec<u8>) -> nibble_discovery::Result<()> {
        self.log.lock().unwrap().puts.push(key.to_string());
        self.inner.put(key, value).await
    }
    async fn get(&self, key: &KvKey) -> nibble_discovery::Result<Option<Vec<u8>>> {
        self.inner.get(key).await
    }
    async fn wait_for(&self, key: &KvKey, t: Duration) -> nibble_discovery::Result<Vec<u8>> {
        self.inner.wait_for(key, t).await
    }
    async fn delete(&self, key: &KvKey) -> nibble_discovery::Result<()> {
        self.log.lock().unwrap().deletes.push(key.to_string());
        self.inner.delete(key).await
    }
    async fn campaign(&self, key: &KvKey, value: Vec<u8>) -> nibble_discovery::Result<bool> {
        self.inner.campaign(key, value).await
    }
    async fn holds(&self, key: &KvKey) -> nibble_discovery::Result<bool> {
        self.inner.holds(key).await
    }
    async fn put_holding(
        &self,
        office: &KvKey,
        key: &KvKey,
        value: Vec<u8>,
        lifetime: nibble_discovery::Lifetime,
    ) -> nibble_discovery::Result<bool> {
        self.inner.put_holding(office, key, value, lifetime).await
    }
    async fn close(&self) -> nibble_discovery::Result<()> {
        self.inner.close().await
    }
}

/// Gives `server` NCCL over `links`, ids through `discovery`; returns the key log.
fn enable(
    server: &Server,
    links: Arc<dyn LinkFactory>,
    discovery: Arc<dyn Discovery>,
    gpu: &str,
    timeout: Duration,
) -> Arc<Mutex<Log>> {
    let log = Arc::new(Mutex::new(Log::default()));
    let recording = Recording {
        inner: discovery,
        log: Arc::clone(&log),
    };
    server
        .state
        .set_nccl(Arc::new(NcclTransport::new(
            links,
            Arc::new(recording),
            server.state.identity().worker_id.clone(),
            NcclEndpoint {
                host: "test".into(),
                gpu: gpu.into(),
            },
            NcclTimeouts {
                timeout,
                retry_after: Duration::from_secs(60),
            },
        )))
        .unwrap();
    log
}

/// The tokens of a gRPC hand-off between fresh workers: what every NCCL hand-off must give.
async fn grpc_tokens() -> Vec<u32> {
    let p = server(v1::WorkerRole::Prefill, "ref-p").await;
    let d = server(v1::WorkerRole::Decode, "ref-d").await;
    let h = handoff_over(
        &p,
        &d,
        "ref",
        &prompt(),
        stopping(),
        v1::TransferBackend::Grpc,
    )
    .await;
    assert_eq!(h.transfer.backend, v1::TransferBackend::Grpc as i32);
    h.tokens
}

async fn nccl_handoff(p: &Server, d: &Server, id: &str) -> Handoff {
    handoff_over(p, d, id, &prompt(), stopping(), v1::TransferBackend::Nccl).await
}

async fn pages_back(servers: [&Server; 2]) {
    for s in servers {
        let load = s.pages_back().await;
        assert_eq!(load.total_pages, PAGES as u64);
    }
}

/// Ids exchanged through `p_discovery`/`d_discovery`: two hand-offs over one pair.
async fn two_handoffs_over_one_pair(
    p_discovery: Arc<dyn Discovery>,
    d_discovery: Arc<dyn Discovery>,
) {
    let expected = grpc_tokens().await;
    let p = server(v1::WorkerRole::Prefill, "prefill-0").await;
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    let hub = MemoryLinks::new();
    let timeout = Duration::from_secs(10);
    let p_log = enable(&p, Arc::new(hub.clone()), p_discovery, "GPU-a", timeout);
    enable(&d, Arc::new(hub), d_discovery, "GPU-b", timeout);

    let first = nccl_handoff(&p, &d, "r1").await;
    assert_eq!(first.tokens, expected, "NCCL moves the same bytes as gRPC");
    assert_eq!(first.transfer.backend, v1::TransferBackend::Nccl as i32);
    let page_bytes = p.state.engine().info().page_bytes as u64;
    assert_eq!(first.transfer.pages, first.reservation.page_count);
    assert_eq!(
        first.transfer.bytes,
        u64::from(first.transfer.pages) * page_bytes
    );

    let second = nccl_handoff(&p, &d, "r2").await;
    assert_eq!(second.transfer.backend, v1::TransferBackend::Nccl as i32);
    let nccl = p.state.nccl().unwrap();
    assert_eq!(
        nccl.connects(),
        1,
        "the pair is set up once, lazily, and reused"
    );
    assert_eq!(nccl.live_links(), 1);
    assert_eq!(d.state.nccl().unwrap().live_links(), 1);

    let sent = p.state.counters().totals();
    let received = d.state.counters().totals();
    assert_eq!((sent.pushes, sent.nccl_pushes, sent.fallbacks), (2, 2, 0));
    assert_eq!(sent.bytes_sent, received.bytes_received);
    assert_eq!(sent.pages_sent, received.pages_received);

    {
        let log = p_log.lock().unwrap();
        assert_eq!(log.puts.len(), 1, "{:?}", log.puts);
        assert!(
            log.puts[0].starts_with("nccl/prefill-0/decode-0/"),
            "the key is scoped by the pair: {}",
            log.puts[0]
        );
        assert_eq!(log.deletes, log.puts, "the id is deleted once both joined");
    }
    pages_back([&p, &d]).await;
    nccl.shutdown().await;
    assert_eq!(nccl.live_links(), 0, "shutdown drops every pair");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_exchanged_through_the_in_process_registry() {
    let registry = StaticRegistry::new();
    two_handoffs_over_one_pair(Arc::new(registry.session()), Arc::new(registry.session())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_exchanged_through_etcd() {
    let etcd = EtcdServer::start();
    let connect = || async {
        let config = EtcdConfig {
            lease_ttl: Duration::from_secs(5),
            ..EtcdConfig::new([etcd.endpoint()])
        };
        Arc::new(EtcdDiscovery::connect(config).await.unwrap()) as Arc<dyn Discovery>
    };
    let (p, d) = (connect().await, connect().await);
    two_handoffs_over_one_pair(Arc::clone(&p), d).await;
    p.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_joins_costs_a_timeout_then_grpc() {
    let expected = grpc_tokens().await;
    let registry = StaticRegistry::new();
    let p = server(v1::WorkerRole::Prefill, "prefill-0").await;
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    // Two hubs: D fetches the id and waits to join, but P's rank is never met.
    let timeout = Duration::from_millis(400);
    let p_log = enable(
        &p,
        Arc::new(MemoryLinks::new()),
        Arc::new(registry.session()),
        "GPU-a",
        timeout,
    );
    enable(
        &d,
        Arc::new(MemoryLinks::new()),
        Arc::new(registry.session()),
        "GPU-b",
        timeout,
    );

    let started = Instant::now();
    let first = nccl_handoff(&p, &d, "r1").await;
    assert!(
        started.elapsed() >= timeout,
        "the set-up waited for its deadline"
    );
    assert_eq!(first.tokens, expected);
    assert_eq!(first.transfer.backend, v1::TransferBackend::Grpc as i32);
    let totals = p.state.counters().totals();
    assert_eq!(
        (totals.pushes, totals.nccl_pushes, totals.fallbacks),
        (1, 0, 1)
    );
    {
        let log = p_log.lock().unwrap();
        assert_eq!(
            log.deletes, log.puts,
            "the id is deleted after a failed set-up too"
        );
    }

    // Within the retry delay the pair stays on gRPC without waiting.
    let started = Instant::now();
    let second = nccl_handoff(&p, &d, "r2").await;
    assert_eq!(second.transfer.backend, v1::TransferBackend::Grpc as i32);
    assert!(started.elapsed() < Duration::from_secs(5));
    let nccl = p.state.nccl().unwrap();
    assert_eq!(
        nccl.connects(),
        1,
        "no second set-up within the retry delay"
    );
    assert_eq!(p.state.counters().totals().fallbacks, 2);
    assert_eq!(nccl.live_links() + d.state.nccl().unwrap().live_links(), 0);
    pages_back([&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_without_nccl_makes_the_prefill_worker_fall_back_at_once() {
    let registry = StaticRegistry::new();
    let p = server(v1::WorkerRole::Prefill, "prefill-0").await;
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    let timeout = Duration::from_secs(30);
    enable(
        &p,
        Arc::new(MemoryLinks::new()),
        Arc::new(registry.session()),
        "GPU-a",
        timeout,
    );
    let started = Instant::now();
    let h = nccl_handoff(&p, &d, "r1").await;
    assert_eq!(h.transfer.backend, v1::TransferBackend::Grpc as i32);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "D's refusal cancels P's join instead of waiting {timeout:?}"
    );
    assert_eq!(p.state.counters().totals().fallbacks, 1);
    pages_back([&p, &d]).await;
}

/// A link factory whose links break on their first send (an NCCL error mid-transfer).
struct BrokenOnSend;

impl Link for BrokenOnSend {
    fn send(&mut self, _: &Staging, _: Duration) -> nibble_nccl::Result<()> {
        Err(nibble_nccl::Error::Link("injected failure".into()))
    }
    fn recv(&mut self, _: &mut Staging, _: usize, _: Duration) -> nibble_nccl::Result<()> {
        Err(nibble_nccl::Error::Link("injected failure".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_failure_mid_transfer_tears_the_pair_down_and_falls_back() {
    let expected = grpc_tokens().await;
    let registry = StaticRegistry::new();
    let p = server(v1::WorkerRole::Prefill, "prefill-0").await;
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    let hub = MemoryLinks::new();
    let timeout = Duration::from_millis(500);
    enable(
        &p,
        Arc::new(hub.wrapped("breaking", |_, _| Box::new(BrokenOnSend))),
        Arc::new(registry.session()),
        "GPU-a",
        timeout,
    );
    enable(
        &d,
        Arc::new(hub),
        Arc::new(registry.session()),
        "GPU-b",
        timeout,
    );

    let h = nccl_handoff(&p, &d, "r1").await;
    assert_eq!(
        h.tokens, expected,
        "the gRPC fall back fills the reservation"
    );
    assert_eq!(h.transfer.backend, v1::TransferBackend::Grpc as i32);
    assert_eq!(p.state.counters().totals().fallbacks, 1);
    assert_eq!(
        p.state.nccl().unwrap().live_links(),
        0,
        "P dropped the broken pair"
    );
    // D's receive times out and drops its end too; nothing it holds stays behind.
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.state.nccl().unwrap().live_links() > 0 {
        assert!(Instant::now() < deadline, "D keeps a broken pair");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pages_back([&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_message_is_checked_before_anything_is_received() {
    let registry = StaticRegistry::new();
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    let plain = server(v1::WorkerRole::Decode, "decode-1").await;
    enable(
        &d,
        Arc::new(MemoryLinks::new()),
        Arc::new(registry.session()),
        "GPU-b",
        Duration::from_secs(1),
    );
    let info = d.state.engine().info().clone();
    let reservation = d.reserve("r", prompt()).await;
    let mut good = v1::NcclPagesRequest {
        sender_id: "prefill-0".into(),
        generation: 1,
        reservation_id: reservation.reservation_id,
        page_indices: (0..reservation.page_count).collect(),
        page_bytes: info.page_bytes as u64,
        kv_format_fingerprint: info.fingerprint,
        request_id: "r".into(),
    };
    let code = |server: &Server, r: v1::NcclPagesRequest| {
        let address = server.address.clone();
        async move {
            let mut client = KvTransferClient::connect(format!("http://{address}"))
                .await
                .unwrap();
            client.nccl_pages(r).await.err().map(|s| s.code())
        }
    };
    let cases = [
        (
            "another format",
            v1::NcclPagesRequest {
                kv_format_fingerprint: 1,
                ..good.clone()
            },
            Code::FailedPrecondition,
        ),
        (
            "another page size",
            v1::NcclPagesRequest {
                page_bytes: 16,
                ..good.clone()
            },
            Code::InvalidArgument,
        ),
        (
            "no pages",
            v1::NcclPagesRequest {
                page_indices: vec![],
                ..good.clone()
            },
            Code::InvalidArgument,
        ),
        (
            "an unknown reservation",
            v1::NcclPagesRequest {
                reservation_id: 12345,
                ..good.clone()
            },
            Code::NotFound,
        ),
        ("no pair with this sender", good.clone(), Code::NotFound),
    ];
    for (what, request, expected) in cases {
        assert_eq!(code(&d, request).await, Some(expected), "{what}");
    }
    assert_eq!(
        code(&plain, good.clone()).await,
        Some(Code::FailedPrecondition),
        "a worker without NCCL"
    );
    let mut client = KvTransferClient::connect(format!("http://{}", plain.address))
        .await
        .unwrap();
    let refused = client
        .nccl_connect(v1::NcclConnectRequest {
            sender_id: "prefill-0".into(),
            key: "nccl/prefill-0/decode-1/x-1".into(),
            generation: 1,
            timeout_ms: 100,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    // An id that never appears: UNAVAILABLE after the deadline.
    let mut client = KvTransferClient::connect(format!("http://{}", d.address))
        .await
        .unwrap();
    let missing = client
        .nccl_connect(v1::NcclConnectRequest {
            sender_id: "prefill-0".into(),
            key: "nccl/prefill-0/decode-0/x-1".into(),
            generation: 1,
            timeout_ms: 100,
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::Unavailable, "{missing}");
    // Nothing was written: the reservation is still waiting for all its pages.
    assert_eq!(d.load().await.pending_reservations, 1);
    // Pages it does not await, or named twice, are refused as over gRPC: the reservation goes.
    for (what, page_indices) in [
        ("a page outside the reservation", vec![999]),
        ("a page named twice", vec![0, 0]),
    ] {
        let request = v1::NcclPagesRequest {
            page_indices,
            ..good.clone()
        };
        assert_eq!(
            code(&d, request).await,
            Some(Code::InvalidArgument),
            "{what}"
        );
        assert_eq!(d.load().await.pending_reservations, 0, "{what}");
        let reservation = d.reserve("r", prompt()).await;
        good.reservation_id = reservation.reservation_id;
    }
    d.client()
        .await
        .abort(v1::AbortRequest {
            request_id: "r".into(),
        })
        .await
        .unwrap();
    d.pages_back().await;
}

/// Links that overwrite what they send with 0xFF (NaN block scales) while `corrupt` is set.
struct Corrupting {
    link: Box<dyn Link>,
    corrupt: Arc<AtomicBool>,
}

impl Link for Corrupting {
    fn send(&mut self, staging: &Staging, timeout: Duration) -> nibble_nccl::Result<()> {
        match self.corrupt.load(Ordering::Relaxed) {
            true => self
                .link
                .send(&Staging::Host(vec![0xFF; staging.len()]), timeout),
            false => self.link.send(staging, timeout),
        }
    }
    fn recv(
        &mut self,
        into: &mut Staging,
        bytes: usize,
        timeout: Duration,
    ) -> nibble_nccl::Result<()> {
        self.link.recv(into, bytes, timeout)
    }
}

/// Pages that arrive over NCCL are checked where they land, as gRPC pushes are: a refusal
/// releases the reservation, fails the prefill without a fall back (the same bytes would be
/// refused over gRPC), keeps the link (it moved the bytes fine), and the next hand-off over
/// the same pair decodes normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_that_fail_their_checks_over_nccl_are_refused() {
    let expected = grpc_tokens().await;
    let registry = StaticRegistry::new();
    let p = server(v1::WorkerRole::Prefill, "prefill-0").await;
    let d = server(v1::WorkerRole::Decode, "decode-0").await;
    let hub = MemoryLinks::new();
    let corrupt = Arc::new(AtomicBool::new(true));
    let links = {
        let corrupt = Arc::clone(&corrupt);
        hub.wrapped("corrupting", move |link, _| {
            Box::new(Corrupting {
                link,
                corrupt: Arc::clone(&corrupt),
            })
        })
    };
    let timeout = Duration::from_secs(10);
    enable(
        &p,
        Arc::new(links),
        Arc::new(registry.session()),
        "GPU-a",
        timeout,
    );
    enable(
        &d,
        Arc::new(hub),
        Arc::new(registry.session()),
        "GPU-b",
        timeout,
    );

    let reservation = d.reserve("attack", prompt()).await;
    let err = p
        .client()
        .await
        .prefill(v1::PrefillRequest {
            request_id: "attack".into(),
            token_ids: prompt(),
            sampling: Some(nibble_testkit::greedy()),
            target: Some(v1::TransferTarget {
                address: d.address.clone(),
                reservation_id: reservation.reservation_id,
                first_page_index: reservation.first_page_index,
                page_count: reservation.page_count,
                page_ids: reservation.page_ids.clone(),
                kv_format_fingerprint: reservation.kv_format_fingerprint,
                backend: v1::TransferBackend::Nccl as i32,
                decode_worker_id: "decode-0".into(),
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    // Refused pages are the cluster's fault, not the router's request's: DATA_LOSS, naming the
    // refusal for the router's log.
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    assert!(
        err.message()
            .contains("page 0 of the reservation: NVFP4 block scale 0xff"),
        "{err}"
    );
    let totals = p.state.counters().totals();
    assert_eq!((totals.pushes, totals.fallbacks), (0, 0), "no fall back");
    assert_eq!(d.state.counters().totals().pages_received, 0);
    let load = d.state.engine().load().await.unwrap();
    assert_eq!(
        d.state.pending_reservations(),
        0,
        "the reservation is released"
    );
    assert_eq!(
        load.free_pages, load.total_pages,
        "no page leaked or cached"
    );
    assert_eq!(p.state.nccl().unwrap().live_links(), 1, "the link stays");

    corrupt.store(false, Ordering::Relaxed);
    let h = nccl_handoff(&p, &d, "after").await;
    assert_eq!(h.transfer.backend, v1::TransferBackend::Nccl as i32);
    assert_eq!(h.reservation.cached_tokens, 0);
    assert_eq!(h.tokens, expected);
    assert_eq!(p.state.nccl().unwrap().connects(), 1, "over the same pair");
    pages_back([&p, &d]).await;
}

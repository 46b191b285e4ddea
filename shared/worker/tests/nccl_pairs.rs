//! NCCL pairs ahead of traffic, pooled staging and transfers in flight, on the CPU: prefill
//! and decode workers as in-process gRPC servers whose device links are `MemoryLinks`, ids and
//! registrations through the in-process registry. Each test checks what a request pays (or
//! does not), what stays allocated, and that every page comes back.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nibble_discovery::{Discovery, Role, StaticRegistry, WorkerId};
use nibble_kvfmt::KvDtype;
use nibble_nccl::link::{Link, LinkFactory, MemoryLinks, Rank, Staging};
use nibble_proto::v1;
use nibble_security::Peers;
use nibble_testkit::{handoff_over, model, Handoff, WorkerApi};
use nibble_worker::membership::worker_info;
use nibble_worker::transfer::nccl::{NcclLimits, NcclTimeouts, NcclTransport, PairFilter};
use support::{engine, Server, PAGES};
use tokio::sync::Notify;

const PROMPT: &str =
    "It is a truth universally acknowledged, that a single man in possession of a good \
     fortune, must be in want of a wife.";

/// The test prompt with its first token replaced by the `i`-th token of the prompt: prompts of
/// one length (so one size of transfer) that share no cached page.
fn prompt(i: usize) -> Vec<u32> {
    let mut tokens = model().1.encode(PROMPT, false).unwrap();
    tokens[0] = tokens[i];
    tokens
}

fn stopping() -> v1::StoppingCriteria {
    v1::StoppingCriteria {
        max_tokens: Some(4),
        ..Default::default()
    }
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// A prefill and a decode worker with NCCL over `p_links`/`d_links` (one hub between them
/// unless a test wraps one), both in `registry`'s membership once [`Pair::register`] is called.
struct Pair {
    p: Server,
    d: Server,
    p_session: Arc<dyn Discovery>,
    d_session: Arc<dyn Discovery>,
    _pairing: Vec<tokio::task::JoinHandle<()>>,
}

impl Pair {
    async fn start(
        p_links: Arc<dyn LinkFactory>,
        d_links: Arc<dyn LinkFactory>,
        limits: NcclLimits,
    ) -> Self {
        let registry = StaticRegistry::new();
        let p = Server::start(
            engine(KvDtype::Nvfp4),
            v1::WorkerRole::Prefill,
            "prefill-0".into(),
        )
        .await;
        let d = Server::start(
            engine(KvDtype::Nvfp4),
            v1::WorkerRole::Decode,
            "decode-0".into(),
        )
        .await;
        let p_session: Arc<dyn Discovery> = Arc::new(registry.session());
        let d_session: Arc<dyn Discovery> = Arc::new(registry.session());
        let mut pairing = Vec::new();
        for (server, links, session, gpu, sender) in [
            (&p, p_links, &p_session, "GPU-a", true),
            (&d, d_links, &d_session, "GPU-b", false),
        ] {
            let nccl = Arc::new(NcclTransport::with_limits(
                links,
                Arc::clone(session),
                server.state.identity().worker_id.clone(),
                nibble_discovery::NcclEndpoint {
                    host: "test".into(),
                    gpu: gpu.into(),
                },
                NcclTimeouts {
                    timeout: TIMEOUT,
                    retry_after: Duration::from_secs(60),
                },
                limits,
            ));
            server.state.set_nccl(Arc::clone(&nccl)).unwrap();
            pairing.push(nccl.spawn_pairing(
                Peers::default(),
                PairFilter {
                    fingerprint: server.state.engine().info().fingerprint,
                    is_sender: Arc::new(move || sender),
                },
            ));
        }
        Self {
            p,
            d,
            p_session,
            d_session,
            _pairing: pairing,
        }
    }

    fn p_nccl(&self) -> &Arc<NcclTransport> {
        self.p.state.nccl().unwrap()
    }

    fn d_nccl(&self) -> &Arc<NcclTransport> {
        self.d.state.nccl().unwrap()
    }

    async fn register(&self, which: Role) {
        let (server, session) = match which {
            Role::Prefill => (&self.p, &self.p_session),
            _ => (&self.d, &self.d_session),
        };
        let info = worker_info(&server.state, which, &server.address)
            .await
            .unwrap();
        session.register(info).await.unwrap();
    }

    async fn deregister(&self, which: Role) {
        let (server, session) = match which {
            Role::Prefill => (&self.p, &self.p_session),
            _ => (&self.d, &self.d_session),
        };
        let id = WorkerId::new(server.state.identity().worker_id.clone()).unwrap();
        session.deregister(which, &id).await.unwrap();
    }

    async fn handoff(&self, id: &str, prompt: &[u32]) -> Handoff {
        handoff_over(
            &self.p,
            &self.d,
            id,
            prompt,
            stopping(),
            v1::TransferBackend::Nccl,
        )
        .await
    }

    async fn pages_back(&self) {
        for s in [&self.p, &self.d] {
            assert_eq!(s.pages_back().await.total_pages, PAGES as u64);
        }
        assert_eq!(self.d.state.pending_reservations(), 0);
    }
}

/// Waits until `cond` holds, at most 30 s (a loaded 2-core CI machine runs the model slowly).
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The tokens of gRPC hand-offs of `prompts` between fresh workers: what NCCL must give.
async fn grpc_tokens(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let p = Server::start(
        engine(KvDtype::Nvfp4),
        v1::WorkerRole::Prefill,
        "ref-p".into(),
    )
    .await;
    let d = Server::start(
        engine(KvDtype::Nvfp4),
        v1::WorkerRole::Decode,
        "ref-d".into(),
    )
    .await;
    let mut tokens = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let h = handoff_over(
            &p,
            &d,
            &format!("ref-{i}"),
            prompt,
            stopping(),
            v1::TransferBackend::Grpc,
        )
        .await;
        tokens.push(h.tokens);
    }
    tokens
}

fn one_hub() -> (Arc<dyn LinkFactory>, Arc<dyn LinkFactory>) {
    let hub = MemoryLinks::new();
    (Arc::new(hub.clone()), Arc::new(hub))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_is_set_up_when_the_decode_worker_registers_not_on_a_request() {
    let expected = grpc_tokens(&[prompt(1)]).await;
    let (p_links, d_links) = one_hub();
    let pair = Pair::start(p_links, d_links, NcclLimits::default()).await;
    pair.register(Role::Prefill).await;
    assert!(
        !pair.p_nccl().has_link_to("decode-0"),
        "no decode worker yet"
    );
    pair.register(Role::Decode).await;
    until("the pair is up", || pair.p_nccl().has_link_to("decode-0")).await;
    assert_eq!(pair.d_nccl().live_links(), 1, "D joined the same pair");

    let first = pair.handoff("r1", &prompt(1)).await;
    assert_eq!(first.transfer.backend, v1::TransferBackend::Nccl as i32);
    assert_eq!(first.tokens, expected[0]);
    let totals = pair.p_nccl().connect_totals();
    assert_eq!(
        (totals.ahead, totals.on_request, totals.failed),
        (1, 0, 0),
        "the first request found the pair up: {totals:?}"
    );
    assert_eq!(pair.p_nccl().connects(), 1);
    pair.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_during_the_set_up_waits_for_it_instead_of_starting_another() {
    let expected = grpc_tokens(&[prompt(2)]).await;
    let hub = MemoryLinks::new();
    let delay = Duration::from_millis(1500);
    // A slow communicator set-up: the prefill side's join takes `delay` more.
    let slow = hub.wrapped("slow", move |link, _| {
        std::thread::sleep(delay);
        link
    });
    let pair = Pair::start(Arc::new(slow), Arc::new(hub), NcclLimits::default()).await;
    pair.register(Role::Decode).await;
    until("the set-up started", || {
        pair.p_nccl().connect_totals().ahead == 1
    })
    .await;
    assert!(!pair.p_nccl().has_link_to("decode-0"), "still joining");
    let h = pair.handoff("r1", &prompt(2)).await;
    assert_eq!(
        h.transfer.backend,
        v1::TransferBackend::Nccl as i32,
        "the request waited for the pair rather than falling back"
    );
    assert_eq!(h.tokens, expected[0]);
    let totals = pair.p_nccl().connect_totals();
    assert_eq!(
        (totals.ahead, totals.on_request),
        (1, 0),
        "one set-up: {totals:?}"
    );
    assert_eq!(pair.p.state.counters().totals().fallbacks, 0);
    pair.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_buffers_are_reused_on_both_sides_within_the_bound() {
    let (p_links, d_links) = one_hub();
    let pair = Pair::start(p_links, d_links, NcclLimits::default()).await;
    pair.register(Role::Decode).await;
    until("the pair is up", || pair.p_nccl().has_link_to("decode-0")).await;
    pair.handoff("warm", &prompt(1)).await;
    let (p0, d0) = (pair.p_nccl().staging(), pair.d_nccl().staging());
    assert_eq!((p0.allocations, d0.allocations), (1, 1), "{p0:?} {d0:?}");
    for i in 0..12 {
        // D caches what it decoded, so later transfers of these prompts move fewer pages:
        // never more than the first, whose buffer they reuse.
        let h = pair.handoff(&format!("r{i}"), &prompt(1 + i % 4)).await;
        assert_eq!(h.transfer.backend, v1::TransferBackend::Nccl as i32);
    }
    let (p1, d1) = (pair.p_nccl().staging(), pair.d_nccl().staging());
    assert_eq!(
        (p1.allocations, d1.allocations),
        (1, 1),
        "12 more transfers allocated nothing: {p1:?} {d1:?}"
    );
    assert_eq!((p1.reuses, d1.reuses), (12, 12));
    for stats in [p1, d1] {
        assert_eq!(stats.lent_bytes, 0, "every buffer came back: {stats:?}");
        assert_eq!(stats.idle_buffers, 1);
    }
    pair.pages_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_bound_of_zero_keeps_nothing_idle() {
    let (p_links, d_links) = one_hub();
    let limits = NcclLimits {
        staging_pool_bytes: 0,
        ..NcclLimits::default()
    };
    let pair = Pair::start(p_links, d_links, limits).await;
    pair.register(Role::Decode).await;
    until("the pair is up", || pair.p_nccl().has_link_to("decode-0")).await;
    for i in 0..3 {
        pair.handoff(&format!("r{i}"), &prompt(1 + i)).await;
    }
    for stats in [pair.p_nccl().staging(), pair.d_nccl().staging()] {
        assert_eq!(stats.allocations, 3, "{stats:?}");
        assert_eq!((stats.idle_bytes, stats.lent_bytes), (0, 0), "{stats:?}");
    }
    pair.pages_back().await;
}

/// Links that record the bytes of each send and receive; sends wait until `gate` opens (at
/// most 10 s: a wire that stalls until the test saw what it waits for).
struct RecordingLink {
    link: Box<dyn Link>,
    rank: Rank,
    gate: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<(Rank, usize)>>>,
}

impl Link for RecordingLink {
    fn send(&mut self, data: &Staging, timeout: Duration) -> nibble_nccl::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.gate.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.log.lock().unwrap().push((self.rank, data.len()));
        self.link.send(data, timeout)
    }
    fn recv(
        &mut self,
        into: &mut Staging,
        bytes: usize,
        timeout: Duration,
    ) -> nibble_nccl::Result<()> {
        self.link.recv(into, bytes, timeout)?;
        self.log.lock().unwrap().push((self.rank, into.len()));
        Ok(())
    }
}

/// Three hand-offs of one pair at once (as many reservations as the test pool holds), two in
/// flight at a time: each lands in its own
/// reservation (their prompts differ, so a transfer matched with another's reservation would
/// decode other tokens), sends and receives pair up in order, and while the first send stalls
/// the next transfer gathers (a second staging buffer) and the third waits (no third buffer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_transfers_of_a_pair_in_flight_arrive_in_order() {
    let prompts: Vec<Vec<u32>> = (1..=3).map(prompt).collect();
    let expected = grpc_tokens(&prompts).await;
    let hub = MemoryLinks::new();
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(AtomicBool::new(false));
    let links = || -> Arc<dyn LinkFactory> {
        let (gate, log) = (Arc::clone(&gate), Arc::clone(&log));
        Arc::new(hub.wrapped("recording", move |link, rank| {
            Box::new(RecordingLink {
                link,
                rank,
                gate: Arc::clone(&gate),
                log: Arc::clone(&log),
            })
        }))
    };
    let limits = NcclLimits {
        max_in_flight: 2,
        ..NcclLimits::default()
    };
    let pair = Pair::start(links(), links(), limits).await;
    pair.register(Role::Decode).await;
    until("the pair is up", || pair.p_nccl().has_link_to("decode-0")).await;

    let h = |i: usize| pair.handoff(["r0", "r1", "r2"][i], &prompts[i]);
    let open = async {
        until("a second transfer gathered while the first sends", || {
            pair.p_nccl().staging().allocations == 2
        })
        .await;
        gate.store(true, Ordering::Relaxed);
    };
    let done = tokio::join!(h(0), h(1), h(2), open);
    let done = [done.0, done.1, done.2];
    for (i, h) in done.iter().enumerate() {
        assert_eq!(h.transfer.backend, v1::TransferBackend::Nccl as i32, "r{i}");
        assert_eq!(h.tokens, expected[i], "r{i} decoded its own pages");
    }
    assert_eq!(pair.p.state.counters().totals().fallbacks, 0);
    let log = log.lock().unwrap().clone();
    let sent: Vec<usize> = log
        .iter()
        .filter(|(r, _)| *r == Rank::Sender)
        .map(|e| e.1)
        .collect();
    let received: Vec<usize> = log
        .iter()
        .filter(|(r, _)| *r == Rank::Receiver)
        .map(|e| e.1)
        .collect();
    assert_eq!(sent.len(), 3);
    assert_eq!(sent, received, "each receive matched its send");
    let p = pair.p_nccl().staging();
    assert_eq!(
        p.allocations, 2,
        "two transfers held gathered buffers at once, never more: {p:?}"
    );
    assert_eq!(p.lent_bytes, 0);
    pair.pages_back().await;
}

/// D's receives fail once `vanish` is set, after telling `mid` (D dies mid-transfer).
struct VanishingLink {
    link: Box<dyn Link>,
    vanish: Arc<AtomicBool>,
    mid: Arc<Notify>,
}

impl Link for VanishingLink {
    fn send(&mut self, data: &Staging, timeout: Duration) -> nibble_nccl::Result<()> {
        self.link.send(data, timeout)
    }
    fn recv(
        &mut self,
        into: &mut Staging,
        bytes: usize,
        timeout: Duration,
    ) -> nibble_nccl::Result<()> {
        if self.vanish.swap(false, Ordering::Relaxed) {
            self.mid.notify_one();
            std::thread::sleep(Duration::from_millis(300));
            return Err(nibble_nccl::Error::Link("the peer vanished".into()));
        }
        self.link.recv(into, bytes, timeout)
    }
}

/// The decode worker's link dies mid-transfer and it leaves the membership: the request falls
/// back to gRPC and decodes, the pair is dropped, no page, reservation or staging buffer stays
/// behind; when the decode worker registers again the pair is set up ahead of traffic again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_disappears_mid_transfer_is_dropped_and_paired_again_on_return() {
    let expected = grpc_tokens(&[prompt(3), prompt(4)]).await;
    let hub = MemoryLinks::new();
    let (vanish, mid) = (Arc::new(AtomicBool::new(false)), Arc::new(Notify::new()));
    let d_links = {
        let (vanish, mid) = (Arc::clone(&vanish), Arc::clone(&mid));
        hub.wrapped("vanishing", move |link, _| {
            Box::new(VanishingLink {
                link,
                vanish: Arc::clone(&vanish),
                mid: Arc::clone(&mid),
            })
        })
    };
    let pair = Pair::start(Arc::new(hub), Arc::new(d_links), NcclLimits::default()).await;
    pair.register(Role::Prefill).await;
    pair.register(Role::Decode).await;
    until("the pair is up", || pair.p_nccl().has_link_to("decode-0")).await;
    until("D joined", || pair.d_nccl().live_links() == 1).await;

    vanish.store(true, Ordering::Relaxed);
    let first = prompt(3);
    let request = pair.handoff("r1", &first);
    let leave = async {
        mid.notified().await;
        pair.deregister(Role::Decode).await;
    };
    let (h, ()) = tokio::join!(request, leave);
    assert_eq!(h.transfer.backend, v1::TransferBackend::Grpc as i32);
    assert_eq!(
        h.tokens, expected[0],
        "the gRPC fall back filled the reservation"
    );
    assert_eq!(pair.p.state.counters().totals().fallbacks, 1);
    until("P dropped the pair", || {
        !pair.p_nccl().has_link_to("decode-0")
    })
    .await;
    until("D dropped its end", || pair.d_nccl().live_links() == 0).await;
    pair.pages_back().await;
    for stats in [pair.p_nccl().staging(), pair.d_nccl().staging()] {
        assert_eq!(
            stats.lent_bytes, 0,
            "no staging buffer left lent: {stats:?}"
        );
    }

    pair.register(Role::Decode).await;
    until("the pair is up again", || {
        pair.p_nccl().has_link_to("decode-0")
    })
    .await;
    let h = pair.handoff("r2", &prompt(4)).await;
    assert_eq!(h.transfer.backend, v1::TransferBackend::Nccl as i32);
    assert_eq!(h.tokens, expected[1]);
    let totals = pair.p_nccl().connect_totals();
    assert_eq!(
        (totals.ahead, totals.on_request),
        (2, 0),
        "both set-ups ahead of traffic: {totals:?}"
    );
    pair.pages_back().await;
}

/// A prefill worker that leaves has the decode worker's end of its pair dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_leaves_has_its_receiving_pair_dropped() {
    let (p_links, d_links) = one_hub();
    let pair = Pair::start(p_links, d_links, NcclLimits::default()).await;
    pair.register(Role::Prefill).await;
    pair.register(Role::Decode).await;
    until("D joined", || pair.d_nccl().live_links() == 1).await;
    pair.deregister(Role::Prefill).await;
    until("D dropped the pair", || pair.d_nccl().live_links() == 0).await;
}

/// A decode worker that accepts connections and never answers: the set-up fails within twice
/// its deadline instead of holding the pair's turn (and every request waiting for it) forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_up_with_a_peer_that_never_answers_ends_at_its_deadline() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = silent.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            sockets.push(socket);
        }
    });
    let timeout = Duration::from_millis(300);
    let nccl = Arc::new(NcclTransport::new(
        Arc::new(MemoryLinks::new()),
        Arc::new(StaticRegistry::new().session()),
        "prefill-0".into(),
        nibble_discovery::NcclEndpoint {
            host: "test".into(),
            gpu: "GPU-a".into(),
        },
        NcclTimeouts {
            timeout,
            retry_after: Duration::from_secs(60),
        },
    ));
    let started = Instant::now();
    let err = nccl
        .connect_ahead("decode-0", &address, &Peers::default())
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        err.to_string().contains("did not answer NcclConnect"),
        "{err}"
    );
    let totals = nccl.connect_totals();
    assert_eq!((totals.ahead, totals.failed), (1, 1));
    assert!(!nccl.has_link_to("decode-0"));
    assert!(
        !nccl
            .connect_ahead("decode-0", &address, &Peers::default())
            .await
            .unwrap(),
        "within the retry delay nothing is tried"
    );
    held.abort();
}

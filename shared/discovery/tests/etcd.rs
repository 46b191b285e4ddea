//! `EtcdDiscovery` against a real etcd process: the shared conformance suite, and what only a
//! real server can show (lease expiry, restarts with and without data loss).
//!
//! These tests fail, with instructions, when etcd is not installed.

mod conformance;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use conformance::{next_event, worker, NewSession, EVENT_WAIT};
use nibble_discovery::{
    Discovery, EtcdConfig, EtcdDiscovery, KvKey, Role, WorkerEvent, WorkerId, WorkerInfo,
    WorkerWatch,
};
use nibble_testkit::EtcdServer;

/// A short lease, so expiry is quick to observe.
const TTL: Duration = Duration::from_secs(2);

fn config(etcd: &EtcdServer, root: &str) -> EtcdConfig {
    EtcdConfig {
        root: root.to_string(),
        lease_ttl: TTL,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
        retry_interval: Duration::from_millis(200),
        ..EtcdConfig::new([etcd.endpoint()])
    }
}

async fn connect(etcd: &EtcdServer, root: &str) -> EtcdDiscovery {
    EtcdDiscovery::connect(config(etcd, root))
        .await
        .expect("connect to the test etcd")
}

fn sessions(etcd: &EtcdServer, root: &str) -> NewSession {
    let config = config(etcd, root);
    Box::new(move || {
        let config = config.clone();
        Box::pin(async move {
            let session: Box<dyn Discovery> =
                Box::new(EtcdDiscovery::connect(config).await.expect("connect"));
            session
        })
    })
}

/// Polls `check` until it holds, failing the test after `limit`.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within {limit:?}");
}

/// Applies events to a consumer's view until it satisfies `done`.
async fn watch_until(
    watch: &mut WorkerWatch,
    view: &mut BTreeMap<(Role, WorkerId), WorkerInfo>,
    done: impl Fn(&BTreeMap<(Role, WorkerId), WorkerInfo>) -> bool,
) {
    while !done(view) {
        match next_event(watch).await {
            WorkerEvent::Added(w) | WorkerEvent::Updated(w) => {
                view.insert((w.role, w.id.clone()), w);
            }
            WorkerEvent::Removed { role, id } => {
                view.remove(&(role, id));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite() {
    let etcd = EtcdServer::start();
    conformance::lifecycle(&sessions(&etcd, "/t/lifecycle")).await;
    conformance::roles_and_order(&sessions(&etcd, "/t/roles")).await;
    conformance::ownership(&sessions(&etcd, "/t/ownership")).await;
    conformance::close_ends_the_session(&sessions(&etcd, "/t/close")).await;
    conformance::key_values(&sessions(&etcd, "/t/kv")).await;
    conformance::elections(&sessions(&etcd, "/t/elections")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_outlives_its_ttl_and_expires_with_its_process() {
    let etcd = EtcdServer::start();
    let observer = connect(&etcd, "/t").await;
    let process = connect(&etcd, "/t").await;
    let d0 = worker(Role::Decode, "d0", 1);
    process.register(d0.clone()).await.unwrap();

    let mut watch = observer.watch(None).await.unwrap();
    assert_eq!(next_event(&mut watch).await, WorkerEvent::Added(d0.clone()));

    // Keep-alive holds the registration well past the TTL.
    tokio::time::sleep(TTL * 3).await;
    assert_eq!(observer.list(None).await.unwrap(), vec![d0]);

    // A process that dies stops renewing; etcd removes its key when the lease expires.
    let died = tokio::time::Instant::now();
    drop(process);
    assert_eq!(
        next_event(&mut watch).await,
        WorkerEvent::Removed {
            role: Role::Decode,
            id: WorkerId::new("d0").unwrap()
        }
    );
    assert!(
        died.elapsed() < TTL + Duration::from_secs(8),
        "removed after {:?}",
        died.elapsed()
    );
    assert!(observer.list(None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registers_again_after_etcd_loses_its_data() {
    let mut etcd = EtcdServer::start();
    let observer = connect(&etcd, "/t").await;
    let process = connect(&etcd, "/t").await;
    let p0 = worker(Role::Prefill, "p0", 7);
    let key = KvKey::new("nccl/p0/d0").unwrap();
    process.register(p0.clone()).await.unwrap();
    process.put(&key, b"nccl-id".to_vec()).await.unwrap();
    let first_lease = process.lease_id().await;

    let mut watch = observer.watch(None).await.unwrap();
    let mut view = BTreeMap::new();
    watch_until(&mut watch, &mut view, |v| v.len() == 1).await;

    // etcd comes back empty: every key and the lease are gone.
    etcd.restart(true);

    eventually("the worker is registered again", EVENT_WAIT, || async {
        observer
            .list(None)
            .await
            .is_ok_and(|l| l == vec![p0.clone()])
    })
    .await;
    assert_ne!(process.lease_id().await, first_lease, "a new lease");
    assert_eq!(observer.get(&key).await.unwrap(), Some(b"nccl-id".to_vec()));

    // The registration is live: updates still work under the new lease.
    let capacity = nibble_discovery::Capacity {
        free_pages: 3,
        total_pages: 1000,
    };
    process
        .update_capacity(Role::Prefill, &p0.id, capacity)
        .await
        .unwrap();

    // The observer's watch recovered too and converges on the same view.
    watch_until(&mut watch, &mut view, |v| {
        v.values().any(|w| w.id == p0.id && w.capacity == capacity)
    })
    .await;
    assert_eq!(view.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_and_leases_survive_an_etcd_restart() {
    let mut etcd = EtcdServer::start();
    let observer = connect(&etcd, "/t").await;
    let process = connect(&etcd, "/t").await;
    let d0 = worker(Role::Decode, "d0", 1);
    process.register(d0.clone()).await.unwrap();
    let lease = process.lease_id().await;

    let mut watch = observer.watch(Some(Role::Decode)).await.unwrap();
    assert_eq!(next_event(&mut watch).await, WorkerEvent::Added(d0.clone()));

    etcd.restart(false);

    // Changes after the restart reach the watch, from an existing session and a new one.
    let d1 = worker(Role::Decode, "d1", 2);
    eventually("register after the restart", EVENT_WAIT, || async {
        process.register(d1.clone()).await.is_ok()
    })
    .await;
    let mut view = BTreeMap::new();
    view.insert((d0.role, d0.id.clone()), d0.clone());
    watch_until(&mut watch, &mut view, |v| v.len() == 2).await;

    let late = connect(&etcd, "/t").await;
    let d2 = worker(Role::Decode, "d2", 3);
    late.register(d2.clone()).await.unwrap();
    assert_eq!(next_event(&mut watch).await, WorkerEvent::Added(d2));
    late.close().await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        WorkerEvent::Removed {
            role: Role::Decode,
            id: WorkerId::new("d2").unwrap()
        }
    );

    // The original lease is still renewed: d0 outlives several TTLs after the restart.
    tokio::time::sleep(TTL * 3).await;
    assert_eq!(process.lease_id().await, lease, "the same lease");
    assert_eq!(observer.list(None).await.unwrap(), vec![d0, d1]);
}

/// A process started while etcd is down waits for it and registers once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_waits_for_an_etcd_that_is_down() {
    let mut etcd = EtcdServer::start();
    etcd.kill();
    let connecting = tokio::spawn(EtcdDiscovery::connect_retrying(config(&etcd, "/wait")));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!connecting.is_finished(), "no etcd yet: still waiting");
    etcd.restart(false);
    let discovery = tokio::time::timeout(Duration::from_secs(20), connecting)
        .await
        .expect("connected once etcd came back")
        .unwrap();
    discovery
        .register(worker(Role::Decode, "late", 4))
        .await
        .unwrap();
    let listed = discovery.list(Some(Role::Decode)).await.unwrap();
    assert_eq!(listed.len(), 1);
    discovery.close().await.unwrap();
}

/// Without etcd, connecting fails with a cause of a few words, and the line a retrying process
/// logs says where, why and which flag, on one line with no debug structure.
#[tokio::test]
async fn an_unreachable_etcd_is_named_in_one_line() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let config = EtcdConfig {
        connect_timeout: Duration::from_secs(2),
        ..EtcdConfig::new([endpoint.clone()])
    };
    let err = EtcdDiscovery::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.brief(), "connection refused", "{err:?}");
    let hint = nibble_discovery::unreachable_hint(&config, &err, Duration::from_millis(200));
    assert_eq!(
        hint,
        format!(
            "etcd at {endpoint} is not reachable (connection refused); retrying in 0.2 s — is \
             etcd running? (--etcd-endpoints)"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_office_goes_with_its_lease_and_is_not_taken_back_on_renewal() {
    let mut etcd = EtcdServer::start();
    let office = KvKey::new("planner/leader").unwrap();
    let fenced = KvKey::new("planner/decision").unwrap();
    let leader = connect(&etcd, "/t").await;
    let standby = connect(&etcd, "/t").await;
    assert!(leader.campaign(&office, b"leader".to_vec()).await.unwrap());
    assert!(!standby
        .campaign(&office, b"standby".to_vec())
        .await
        .unwrap());

    // etcd loses its data: the leader's session renews its lease and writes its registrations
    // again, but not the office, which it has lost.
    let registered = worker(Role::Decode, "d0", 1);
    leader.register(registered.clone()).await.unwrap();
    etcd.restart(true);
    eventually("the registration is back", EVENT_WAIT, || async {
        standby
            .list(None)
            .await
            .is_ok_and(|l| l == vec![registered.clone()])
    })
    .await;
    assert!(!leader.holds(&office).await.unwrap());
    assert!(!leader
        .put_holding(
            &office,
            &fenced,
            b"late".to_vec(),
            nibble_discovery::Lifetime::Session
        )
        .await
        .unwrap());
    assert!(standby
        .campaign(&office, b"standby".to_vec())
        .await
        .unwrap());
    assert!(!leader.campaign(&office, b"leader".to_vec()).await.unwrap());

    // A leader that dies (no close) keeps the office until its lease expires, then a standby
    // takes it within the TTL.
    let died = tokio::time::Instant::now();
    drop(standby);
    eventually(
        "the office is free again",
        TTL + Duration::from_secs(8),
        || async {
            leader
                .campaign(&office, b"leader".to_vec())
                .await
                .unwrap_or(false)
        },
    )
    .await;
    assert!(
        died.elapsed() >= TTL / 2,
        "the office outlived its holder's death for a while"
    );
    assert_eq!(leader.get(&office).await.unwrap(), Some(b"leader".to_vec()));
}

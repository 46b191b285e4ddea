//! The behaviour every `Discovery` implementation must have, written once and run against each
//! (`tests/static_registry.rs`, `tests/etcd.rs`).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use nibble_discovery::{
    Addresses, Capacity, Discovery, Error, KvKey, Lifetime, Role, WorkerEvent, WorkerId,
    WorkerInfo, WorkerWatch,
};

/// Opens a new session (a new "process") on the implementation under test.
pub type NewSession =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Box<dyn Discovery>> + Send>> + Send + Sync>;

/// Longest wait for an expected event.
pub const EVENT_WAIT: Duration = Duration::from_secs(15);

pub fn id(id: &str) -> WorkerId {
    WorkerId::new(id).unwrap()
}

pub fn worker(role: Role, name: &str, free: u64) -> WorkerInfo {
    WorkerInfo {
        role,
        id: id(name),
        addresses: Addresses {
            grpc: format!("127.0.0.1:{}", 5000 + free),
            ..Addresses::default()
        },
        model: "smollm2-135m".into(),
        kv_fingerprint: 0xdead_beef_0000_0001,
        page_size: 16,
        capacity: Capacity {
            free_pages: free,
            total_pages: 1000,
        },
        nccl: None,
        draining: false,
    }
}

/// The next event, failing the test if none comes in time.
pub async fn next_event(watch: &mut WorkerWatch) -> WorkerEvent {
    match tokio::time::timeout(EVENT_WAIT, watch.next()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("the watch ended"),
        Err(_) => panic!("no watch event within {EVENT_WAIT:?}"),
    }
}

fn removed(role: Role, name: &str) -> WorkerEvent {
    WorkerEvent::Removed { role, id: id(name) }
}

pub async fn lifecycle(new: &NewSession) {
    let owner = new().await;
    let observer = new().await;
    let p0 = worker(Role::Prefill, "p0", 10);
    owner.register(p0.clone()).await.unwrap();

    let mut watch = observer.watch(None).await.unwrap();
    assert_eq!(next_event(&mut watch).await, WorkerEvent::Added(p0.clone()));

    let d0 = worker(Role::Decode, "d0", 20);
    owner.register(d0.clone()).await.unwrap();
    assert_eq!(next_event(&mut watch).await, WorkerEvent::Added(d0.clone()));

    let capacity = Capacity {
        free_pages: 5,
        total_pages: 1000,
    };
    owner
        .update_capacity(Role::Decode, &d0.id, capacity)
        .await
        .unwrap();
    let updated = WorkerInfo {
        capacity,
        ..d0.clone()
    };
    assert_eq!(
        next_event(&mut watch).await,
        WorkerEvent::Updated(updated.clone())
    );
    assert_eq!(
        observer.list(None).await.unwrap(),
        vec![p0.clone(), updated]
    );

    owner.deregister(Role::Decode, &d0.id).await.unwrap();
    assert_eq!(next_event(&mut watch).await, removed(Role::Decode, "d0"));
    assert_eq!(observer.list(None).await.unwrap(), vec![p0]);
    owner.close().await.unwrap();
    observer.close().await.unwrap();
}

pub async fn roles_and_order(new: &NewSession) {
    let s = new().await;
    for w in [
        worker(Role::Router, "r1", 0),
        worker(Role::Decode, "d-b", 2),
        worker(Role::Prefill, "p-x", 3),
        worker(Role::Decode, "d-a", 1),
    ] {
        s.register(w).await.unwrap();
    }
    let names = |ws: Vec<WorkerInfo>| {
        ws.into_iter()
            .map(|w| format!("{}/{}", w.role, w.id))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(s.list(None).await.unwrap()),
        ["prefill/p-x", "decode/d-a", "decode/d-b", "router/r1"]
    );
    assert_eq!(
        names(s.list(Some(Role::Decode)).await.unwrap()),
        ["decode/d-a", "decode/d-b"]
    );

    let mut prefill_only = s.watch(Some(Role::Prefill)).await.unwrap();
    assert_eq!(
        next_event(&mut prefill_only).await,
        WorkerEvent::Added(worker(Role::Prefill, "p-x", 3))
    );
    // A decode worker's change is not reported to a prefill watch: the next event is p-y's.
    s.register(worker(Role::Decode, "d-c", 4)).await.unwrap();
    s.register(worker(Role::Prefill, "p-y", 5)).await.unwrap();
    assert_eq!(
        next_event(&mut prefill_only).await,
        WorkerEvent::Added(worker(Role::Prefill, "p-y", 5))
    );
    s.close().await.unwrap();
}

pub async fn ownership(new: &NewSession) {
    let first = new().await;
    let second = new().await;
    let d0 = worker(Role::Decode, "d0", 1);
    first.register(d0.clone()).await.unwrap();

    let err = second.register(d0.clone()).await.unwrap_err();
    assert!(matches!(err, Error::AlreadyRegistered { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "worker decode/d0 is already registered by another process"
    );
    let capacity = Capacity::default();
    assert!(matches!(
        second.update_capacity(Role::Decode, &d0.id, capacity).await,
        Err(Error::NotRegistered { .. })
    ));
    assert!(matches!(
        second.deregister(Role::Decode, &d0.id).await,
        Err(Error::NotRegistered { .. })
    ));
    assert!(matches!(
        first.update_capacity(Role::Prefill, &d0.id, capacity).await,
        Err(Error::NotRegistered { .. })
    ));

    // The owner may register again, replacing its entry.
    let moved = WorkerInfo {
        model: "other-model".into(),
        ..d0.clone()
    };
    first.register(moved.clone()).await.unwrap();
    assert_eq!(second.list(None).await.unwrap(), vec![moved]);
    first.close().await.unwrap();
    second.close().await.unwrap();
}

pub async fn close_ends_the_session(new: &NewSession) {
    let owner = new().await;
    let observer = new().await;
    let key = KvKey::new("nccl/p0/d0").unwrap();
    owner.register(worker(Role::Decode, "d0", 1)).await.unwrap();
    owner.put(&key, b"unique-id".to_vec()).await.unwrap();

    let mut watch = observer.watch(None).await.unwrap();
    assert!(matches!(
        next_event(&mut watch).await,
        WorkerEvent::Added(_)
    ));
    let mut own_watch = owner.watch(None).await.unwrap();

    owner.close().await.unwrap();
    assert_eq!(next_event(&mut watch).await, removed(Role::Decode, "d0"));
    assert_eq!(observer.get(&key).await.unwrap(), None);
    assert!(observer.list(None).await.unwrap().is_empty());

    // The closed session refuses everything, and its own watches end.
    assert!(matches!(owner.list(None).await, Err(Error::Closed)));
    assert!(matches!(
        owner.register(worker(Role::Decode, "d1", 1)).await,
        Err(Error::Closed)
    ));
    assert!(matches!(owner.close().await, Err(Error::Closed)));
    let ended = tokio::time::timeout(EVENT_WAIT, async {
        while own_watch.next().await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "a closed session's watch ends");
    observer.close().await.unwrap();
}

pub async fn key_values(new: &NewSession) {
    let writer = new().await;
    let reader = new().await;
    let key = KvKey::new("nccl/prefill-0/decode-1").unwrap();
    assert_eq!(reader.get(&key).await.unwrap(), None);
    writer.put(&key, vec![1, 2, 3]).await.unwrap();
    assert_eq!(reader.get(&key).await.unwrap(), Some(vec![1, 2, 3]));
    writer.put(&key, vec![4]).await.unwrap();
    assert_eq!(reader.get(&key).await.unwrap(), Some(vec![4]));

    // A reader waits for a value put later.
    let later = KvKey::new("nccl/later").unwrap();
    let (waited, put) = tokio::join!(reader.wait_for(&later, EVENT_WAIT), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        writer.put(&later, b"id".to_vec()).await
    });
    put.unwrap();
    assert_eq!(waited.unwrap(), b"id");
    // An existing value is returned at once.
    assert_eq!(
        reader
            .wait_for(&later, Duration::from_millis(1))
            .await
            .unwrap(),
        b"id"
    );

    let missing = KvKey::new("nccl/never").unwrap();
    let err = reader
        .wait_for(&missing, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");

    writer.delete(&key).await.unwrap();
    assert_eq!(reader.get(&key).await.unwrap(), None);
    writer.delete(&key).await.unwrap();
    writer.close().await.unwrap();
    reader.close().await.unwrap();
}

/// One session at a time holds an office; only its holder writes fenced values; a closed
/// session's office is free for the next, and its durable values stay.
pub async fn elections(new: &NewSession) {
    let first = new().await;
    let second = new().await;
    let office = KvKey::new("planner/leader").unwrap();
    let decision = KvKey::new("planner/decision").unwrap();
    let desired = KvKey::new("planner/desired").unwrap();
    assert!(first.campaign(&office, b"first".to_vec()).await.unwrap());
    // Campaigning again while holding it is still holding it; the value stays the first's.
    assert!(first.campaign(&office, b"again".to_vec()).await.unwrap());
    assert!(!second.campaign(&office, b"second".to_vec()).await.unwrap());
    assert_eq!(second.get(&office).await.unwrap(), Some(b"first".to_vec()));
    assert!(first.holds(&office).await.unwrap());
    assert!(!second.holds(&office).await.unwrap());

    // Only the holder's fenced writes land.
    assert!(!second
        .put_holding(&office, &decision, b"2".to_vec(), Lifetime::Session)
        .await
        .unwrap());
    assert_eq!(second.get(&decision).await.unwrap(), None);
    assert!(first
        .put_holding(&office, &decision, b"1".to_vec(), Lifetime::Session)
        .await
        .unwrap());
    assert!(first
        .put_holding(&office, &desired, b"d".to_vec(), Lifetime::Durable)
        .await
        .unwrap());
    assert_eq!(second.get(&decision).await.unwrap(), Some(b"1".to_vec()));

    // The holder's session ends: the office and its session values go, durable ones stay.
    first.close().await.unwrap();
    assert_eq!(second.get(&office).await.unwrap(), None);
    assert_eq!(second.get(&decision).await.unwrap(), None);
    assert_eq!(second.get(&desired).await.unwrap(), Some(b"d".to_vec()));
    assert!(second.campaign(&office, b"second".to_vec()).await.unwrap());
    assert!(second.holds(&office).await.unwrap());
    assert!(second
        .put_holding(&office, &desired, b"e".to_vec(), Lifetime::Durable)
        .await
        .unwrap());
    second.delete(&desired).await.unwrap();
    second.close().await.unwrap();
}

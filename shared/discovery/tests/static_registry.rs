//! The in-process registry: the shared conformance suite, plus what only it can show directly
//! (dropped sessions, watches that fall behind).

mod conformance;

use std::collections::BTreeMap;
use std::time::Duration;

use conformance::{next_event, worker, NewSession};
use nibble_discovery::{Discovery, Role, StaticRegistry, WorkerEvent, WorkerId, WorkerInfo};
use tokio_stream::StreamExt;

fn sessions(registry: &StaticRegistry) -> NewSession {
    let registry = registry.clone();
    Box::new(move || {
        let session: Box<dyn Discovery> = Box::new(registry.session());
        Box::pin(async move { session })
    })
}

#[tokio::test]
async fn lifecycle() {
    conformance::lifecycle(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn roles_and_order() {
    conformance::roles_and_order(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn ownership() {
    conformance::ownership(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn close_ends_the_session() {
    conformance::close_ends_the_session(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn key_values() {
    conformance::key_values(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn elections() {
    conformance::elections(&sessions(&StaticRegistry::new())).await;
}

#[tokio::test]
async fn a_dropped_session_is_a_dead_process() {
    let registry = StaticRegistry::new();
    let observer = registry.session();
    let worker_session = registry.session();
    worker_session
        .register(worker(Role::Prefill, "p0", 1))
        .await
        .unwrap();
    let mut watch = observer.watch(Some(Role::Prefill)).await.unwrap();
    assert!(matches!(
        next_event(&mut watch).await,
        WorkerEvent::Added(_)
    ));

    drop(worker_session);
    assert_eq!(
        next_event(&mut watch).await,
        WorkerEvent::Removed {
            role: Role::Prefill,
            id: WorkerId::new("p0").unwrap()
        }
    );
    assert!(observer.list(None).await.unwrap().is_empty());
    // The id is free again for a new process.
    registry
        .session()
        .register(worker(Role::Prefill, "p0", 1))
        .await
        .unwrap();
}

/// Folds events into the view a consumer would hold, until the watch is quiet.
async fn drain(
    watch: &mut nibble_discovery::WorkerWatch,
    view: &mut BTreeMap<(Role, WorkerId), WorkerInfo>,
) {
    while let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(300), watch.next()).await
    {
        match event {
            WorkerEvent::Added(w) => {
                let key = (w.role, w.id.clone());
                assert!(view.insert(key, w).is_none(), "added twice");
            }
            WorkerEvent::Updated(w) => {
                let key = (w.role, w.id.clone());
                assert!(view.insert(key, w).is_some(), "updated before added");
            }
            WorkerEvent::Removed { role, id } => {
                assert!(view.remove(&(role, id)).is_some(), "removed unknown");
            }
        }
    }
}

#[tokio::test]
async fn a_watch_that_falls_behind_resyncs() {
    // Room for only two changes: a consumer that does not read loses the rest and must resync.
    let registry = StaticRegistry::with_buffer(2);
    let observer = registry.session();
    let owner = registry.session();
    let mut watch = observer.watch(None).await.unwrap();
    let mut view = BTreeMap::new();

    for round in 0..3u64 {
        for i in 0..10u64 {
            let role = if i % 2 == 0 {
                Role::Prefill
            } else {
                Role::Decode
            };
            let w = worker(role, &format!("w{i}"), round);
            if round == 0 {
                owner.register(w).await.unwrap();
            } else if i % 3 == 0 {
                owner.deregister(role, &w.id).await.ok();
            } else {
                owner.register(w).await.unwrap();
            }
        }
        tokio::task::yield_now().await;
    }
    drain(&mut watch, &mut view).await;
    let listed: BTreeMap<(Role, WorkerId), WorkerInfo> = observer
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|w| ((w.role, w.id.clone()), w))
        .collect();
    assert_eq!(view, listed);
    assert_eq!(listed.len(), 6, "w0, w3, w6, w9 were removed");

    // Still live after the resync.
    owner.register(worker(Role::Router, "r0", 0)).await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        WorkerEvent::Added(worker(Role::Router, "r0", 0))
    );
}

#[tokio::test]
async fn a_watch_is_a_stream() {
    let registry = StaticRegistry::new();
    let session = registry.session();
    session
        .register(worker(Role::Decode, "d0", 1))
        .await
        .unwrap();
    let watch = session.watch(None).await.unwrap();
    let first: Vec<WorkerEvent> = watch.take(1).collect().await;
    assert_eq!(
        first,
        vec![WorkerEvent::Added(worker(Role::Decode, "d0", 1))]
    );
}

#[tokio::test]
async fn dropping_the_watch_stops_its_task() {
    let registry = StaticRegistry::with_buffer(1);
    let session = registry.session();
    let watch = session.watch(None).await.unwrap();
    drop(watch);
    // Publishing with no consumer neither blocks nor fails.
    for i in 0..10 {
        session
            .register(worker(Role::Decode, &format!("d{i}"), 1))
            .await
            .unwrap();
    }
    assert_eq!(session.list(None).await.unwrap().len(), 10);
}

use nibble_discovery::{Addresses, Capacity};
use nibble_kvcache::KvEventData;

use super::*;
use crate::SyncStatus;

const MODEL: &str = "smollm2-135m";
const PAGE: u32 = 16;
const FP: u64 = 0xabcd;
const INSTANCE: u64 = 1;

fn info(role: Role, id: &str, fingerprint: u64) -> WorkerInfo {
    WorkerInfo {
        role,
        id: WorkerId::new(id).unwrap(),
        addresses: Addresses {
            grpc: format!("127.0.0.1:{}", 5000 + id.len()),
            ..Addresses::default()
        },
        model: MODEL.into(),
        kv_fingerprint: fingerprint,
        page_size: PAGE,
        capacity: Capacity {
            free_pages: 10_000,
            total_pages: 10_000,
        },
        nccl: None,
        draining: false,
    }
}

fn id(name: &str) -> WorkerId {
    WorkerId::new(name).unwrap()
}

fn router_with(policy: PolicyConfig, prefill: &[&str], decode: &[&str]) -> Router {
    let mut config = RouterConfig::new(MODEL, PAGE);
    config.kv_fingerprint = Some(FP);
    config.policy = policy;
    let mut router = Router::new(config).unwrap();
    for name in prefill {
        router.upsert_worker(info(Role::Prefill, name, FP)).unwrap();
    }
    for name in decode {
        router.upsert_worker(info(Role::Decode, name, FP)).unwrap();
    }
    router
}

fn router(prefill: &[&str], decode: &[&str]) -> Router {
    router_with(PolicyConfig::default(), prefill, decode)
}

/// A prompt of `tokens` tokens whose ids start at `start` (different starts, different prefixes).
fn prompt(start: u32, tokens: u32) -> Prompt {
    let ids: Vec<u32> = (start..start + tokens).collect();
    Prompt::new(&ids, PAGE).unwrap()
}

/// Tells the router that `worker` caches the first `pages` pages of `prompt`.
fn cache(router: &mut Router, role: Role, worker: &str, prompt: &Prompt, pages: usize) {
    let next = router
        .index()
        .last_event_id(router.slot(role, &id(worker)).unwrap());
    let event = KvEvent {
        id: next.unwrap() + 1,
        data: KvEventData::Stored {
            parent: None,
            blocks: prompt.hashes()[..pages].to_vec(),
        },
    };
    let report = router
        .apply_kv_events(role, &id(worker), INSTANCE, &[event])
        .unwrap();
    assert_eq!(report.status, SyncStatus::InSync);
}

fn name(placement: &Placement) -> &str {
    placement.worker.id.as_str()
}

#[test]
fn routes_to_the_decode_worker_holding_the_prefix() {
    let mut router = router(&[], &["d0", "d1", "d2", "d3"]);
    let p = prompt(0, 2048);
    cache(&mut router, Role::Decode, "d2", &p, 100);
    cache(&mut router, Role::Decode, "d1", &p, 10);
    for _ in 0..3 {
        let decision = router.decide(&p, WorkerSet::EMPTY).unwrap();
        assert_eq!(name(&decision.decode), "d2");
        assert_eq!(decision.decode.cached_tokens, 1600);
    }
    // A prompt sharing only the first 10 pages: d1 and d2 both hold them and tie; d0 and d3
    // never win.
    let mut other: Vec<u32> = (0..160).collect();
    other.extend(50_000..51_888);
    let other = Prompt::new(&other, PAGE).unwrap();
    for _ in 0..20 {
        let decision = router.decide(&other, WorkerSet::EMPTY).unwrap();
        assert!(["d1", "d2"].contains(&name(&decision.decode)));
        assert_eq!(decision.decode.cached_tokens, 160);
    }
}

#[test]
fn round_robin_takes_workers_in_turn_whatever_they_cache() {
    let policy = PolicyConfig {
        routing: Routing::RoundRobin,
        ..PolicyConfig::default()
    };
    let mut router = router_with(policy, &["p0", "p1"], &["d0", "d1", "d2"]);
    let p = prompt(0, 2048);
    cache(&mut router, Role::Decode, "d2", &p, 100);
    let mut decodes = Vec::new();
    let mut prefills = Vec::new();
    for _ in 0..6 {
        let routed = router.route(&p, WorkerSet::EMPTY).unwrap();
        decodes.push(name(&routed.decision.decode).to_string());
        prefills.push(
            routed
                .decision
                .prefill
                .as_ref()
                .map(|p| name(p).to_string()),
        );
        // What a worker happens to hold is still reused, and still counted.
        let cached = match decodes.last().unwrap().as_str() {
            "d2" => 1600,
            _ => 0,
        };
        assert_eq!(routed.decision.decode.cached_tokens, cached);
    }
    assert_eq!(decodes, ["d0", "d1", "d2", "d0", "d1", "d2"]);
    // The prompt is long: d2 lacks 448 of its tokens, under the threshold, so it prefills
    // them itself; the others take the prefill workers in turn.
    let prefills: Vec<_> = prefills.iter().map(|p| p.as_deref()).collect();
    assert_eq!(
        prefills,
        [Some("p0"), Some("p1"), None, Some("p0"), Some("p1"), None]
    );
    // A worker left out is skipped, and the turn goes on after it.
    let d0 = router.slot(Role::Decode, &id("d0")).unwrap();
    let mut exclude = WorkerSet::EMPTY;
    exclude.insert(d0);
    let next = router.route(&p, exclude).unwrap();
    assert_eq!(name(&next.decision.decode), "d1");
    let next = router.route(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(name(&next.decision.decode), "d2");
}

#[test]
fn cold_requests_spread_evenly_when_dispatched() {
    let mut router = router(&[], &["d0", "d1", "d2", "d3"]);
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in 0..100 {
        // Every prompt is new: no worker caches anything.
        let routed = router
            .route(&prompt(i * 10_000, 300), WorkerSet::EMPTY)
            .unwrap();
        *counts
            .entry(name(&routed.decision.decode).to_owned())
            .or_default() += 1;
    }
    let (min, max) = (counts.values().min(), counts.values().max());
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert!(
        max.unwrap() - min.unwrap() <= 1,
        "in-flight accounting spreads exactly: {counts:?}"
    );
    assert_eq!(router.stats().in_flight, 100);
}

#[test]
fn equal_scores_spread_without_accounting() {
    // Dry runs (no dispatch, no load change): only the tie-break spreads them.
    let mut router = router(&[], &["d0", "d1", "d2", "d3"]);
    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in 0..100 {
        let decision = router
            .decide(&prompt(i * 10_000, 300), WorkerSet::EMPTY)
            .unwrap();
        *counts.entry(name(&decision.decode).to_owned()).or_default() += 1;
    }
    let (min, max) = (
        *counts.values().min().unwrap(),
        *counts.values().max().unwrap(),
    );
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert!(min >= 12 && max <= 40, "{counts:?}");
}

#[test]
fn the_same_hot_prefix_spreads_once_its_holder_is_loaded() {
    let mut router = router(&[], &["d0", "d1"]);
    let p = prompt(0, 1024);
    cache(&mut router, Role::Decode, "d0", &p, 64);
    let mut on_d0 = 0;
    for _ in 0..20 {
        let routed = router.route(&p, WorkerSet::EMPTY).unwrap();
        on_d0 += usize::from(name(&routed.decision.decode) == "d0");
    }
    // 1,024 cached tokens are worth 8 requests decoding (128 each), and a request sent to d1
    // queues its 1,024 prompt tokens there for the next one to wait behind: d0 takes the first
    // 8, d1 one in about ten after that.
    assert_eq!(on_d0, 18);
}

#[test]
fn prompt_tokens_queued_on_a_worker_steer_away_until_their_first_token() {
    let mut router = router(&[], &["d0", "d1"]);
    let first = router.route(&prompt(0, 2048), WorkerSet::EMPTY).unwrap();
    let busy = name(&first.decision.decode).to_owned();
    let status = router.worker(Role::Decode, &id(&busy)).unwrap();
    assert_eq!(status.load.queued_prefill_tokens, 2048);
    // A short cold prompt goes where no 2,048 prompt tokens are queued ahead of it.
    let second = router
        .decide(&prompt(10_000, 256), WorkerSet::EMPTY)
        .unwrap();
    assert_ne!(name(&second.decode), busy);
    // Its first token came: the worker has computed it, and only the running request weighs.
    assert!(router.first_token(first.ticket));
    let status = router.worker(Role::Decode, &id(&busy)).unwrap();
    assert_eq!(status.load.queued_prefill_tokens, 0);
    assert!(router.finish(first.ticket));
    assert!(!router.first_token(first.ticket));
    let status = router.worker(Role::Decode, &id(&busy)).unwrap();
    assert_eq!(
        (status.load.running, status.load.queued_prefill_tokens),
        (0, 0)
    );
}

#[test]
fn load_reports_steer_away_from_busy_workers() {
    let mut router = router(&[], &["d0", "d1"]);
    let report = LoadReport {
        running: 30,
        waiting: 10,
        free_pages: 100,
        total_pages: 10_000,
        evictable_pages: 0,
        queued_prefill_tokens: 0,
    };
    router.report_load(Role::Decode, &id("d0"), report).unwrap();
    let p = prompt(0, 2048);
    cache(&mut router, Role::Decode, "d0", &p, 128);
    let decision = router.decide(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(name(&decision.decode), "d1", "{decision:?}");
    let status = router.worker(Role::Decode, &id("d0")).unwrap();
    assert_eq!((status.load.running, status.blocks), (30, 128));
}

#[test]
fn kv_cache_usage_sums_the_reachable_workers_reports() {
    let mut router = router(&["p0"], &["d0", "d1"]);
    // Registered with every page free.
    assert_eq!(router.kv_cache_usage(Role::Decode), 0.0);
    let report = |free, evictable| LoadReport {
        running: 1,
        waiting: 0,
        free_pages: free,
        total_pages: 10_000,
        evictable_pages: evictable,
        queued_prefill_tokens: 0,
    };
    // d0 holds 6,000 pages (1,000 more only cached: evictable), d1 holds 2,000.
    router
        .report_load(Role::Decode, &id("d0"), report(3_000, 1_000))
        .unwrap();
    router
        .report_load(Role::Decode, &id("d1"), report(8_000, 0))
        .unwrap();
    assert!((router.kv_cache_usage(Role::Decode) - 0.4).abs() < 1e-12);
    assert_eq!(router.kv_cache_usage(Role::Prefill), 0.0);
    // An unreachable worker is left out.
    router.set_reachable(Role::Decode, &id("d1"), false);
    assert!((router.kv_cache_usage(Role::Decode) - 0.6).abs() < 1e-12);
}

#[test]
fn workers_without_room_are_avoided() {
    let mut router = router(&[], &["d0", "d1"]);
    let full = LoadReport {
        running: 0,
        waiting: 0,
        free_pages: 10,
        total_pages: 10_000,
        evictable_pages: 0,
        queued_prefill_tokens: 0,
    };
    router.report_load(Role::Decode, &id("d0"), full).unwrap();
    // d0 caches half the prompt but has 10 pages for the other 64.
    let p = prompt(0, 2048);
    cache(&mut router, Role::Decode, "d0", &p, 64);
    assert_eq!(
        name(&router.decide(&p, WorkerSet::EMPTY).unwrap().decode),
        "d1"
    );
    // With no room anywhere, the cheapest still gets it.
    router.report_load(Role::Decode, &id("d1"), full).unwrap();
    assert_eq!(
        name(&router.decide(&p, WorkerSet::EMPTY).unwrap().decode),
        "d0"
    );
}

#[test]
fn short_uncached_parts_prefill_locally() {
    let policy = PolicyConfig {
        local_prefill_threshold_tokens: 256,
        ..PolicyConfig::default()
    };
    let mut router = router_with(policy, &["p0"], &["d0"]);
    let short = router.decide(&prompt(0, 255), WorkerSet::EMPTY).unwrap();
    assert_eq!(short.reason, Reason::LocalPrefill);
    assert!(short.prefill.is_none());
    assert_eq!(short.prefill_tokens(), 255);
    assert_eq!(short.transferred_tokens(), 0);

    let long = router.decide(&prompt(0, 256), WorkerSet::EMPTY).unwrap();
    assert_eq!(long.reason, Reason::Disaggregated);
    assert_eq!(name(long.prefill.as_ref().unwrap()), "p0");
    assert_eq!(long.transferred_tokens(), 256);

    // D caches all but 200 tokens of a long prompt: local again.
    let p = prompt(0, 2000);
    cache(&mut router, Role::Decode, "d0", &p, 113);
    let mostly_cached = router.decide(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(mostly_cached.reason, Reason::LocalPrefill);
    assert_eq!(mostly_cached.decode.cached_tokens, 1808);
    assert_eq!(mostly_cached.prefill_tokens(), 192);
}

#[test]
fn the_prefill_worker_is_chosen_by_its_own_cache() {
    let mut router = router(&["p0", "p1", "p2"], &["d0"]);
    let p = prompt(0, 2048);
    cache(&mut router, Role::Prefill, "p1", &p, 96);
    let decision = router.decide(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(decision.reason, Reason::Disaggregated);
    let prefill = decision.prefill.as_ref().unwrap();
    assert_eq!((name(prefill), prefill.cached_tokens), ("p1", 1536));
    assert_eq!(decision.prefill_tokens(), 512);
    assert_eq!(decision.transferred_tokens(), 2048);
}

#[test]
fn no_prefill_workers_means_local_prefill() {
    let mut router = router(&[], &["d0"]);
    let decision = router.decide(&prompt(0, 4096), WorkerSet::EMPTY).unwrap();
    assert_eq!(decision.reason, Reason::NoPrefillWorkers);
    assert!(decision.prefill.is_none());
    // Excluding the only prefill worker does the same.
    let mut router = router_with(PolicyConfig::default(), &["p0"], &["d0"]);
    let p0 = router.slot(Role::Prefill, &id("p0")).unwrap();
    let decision = router
        .decide(&prompt(0, 4096), WorkerSet::only(p0))
        .unwrap();
    assert_eq!(decision.reason, Reason::NoPrefillWorkers);
}

#[test]
fn a_scoring_prompt_is_computed_whole_on_its_decode_worker() {
    let mut router = router(&["p0"], &["d0"]);
    let long = prompt(0, 4096);
    assert_eq!(
        router.decide(&long, WorkerSet::EMPTY).unwrap().reason,
        Reason::Disaggregated
    );
    let decision = router.decide(&long.scored(), WorkerSet::EMPTY).unwrap();
    assert_eq!(decision.reason, Reason::Scoring);
    assert!(decision.prefill.is_none());
}

#[test]
fn no_decode_workers_is_an_error() {
    let mut router = router(&["p0"], &[]);
    assert!(matches!(
        router.decide(&prompt(0, 100), WorkerSet::EMPTY),
        Err(Error::NoDecodeWorkers)
    ));
}

#[test]
fn mismatched_fingerprints_are_refused() {
    let mut router = router(&["p0"], &["d0"]);
    let err = router
        .upsert_worker(info(Role::Prefill, "p1", FP + 1))
        .unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { got, .. } if got == FP + 1));
    assert!(err.to_string().contains("fingerprint"), "{err}");
    assert!(router.worker(Role::Prefill, &id("p1")).is_none());

    // A tracked worker that re-registers with another format is dropped.
    let err = router
        .upsert_worker(info(Role::Prefill, "p0", FP + 1))
        .unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }));
    assert_eq!(router.stats().prefill_workers, 0);
}

#[test]
fn prefill_and_decode_workers_pair_only_with_equal_fingerprints() {
    // No expected fingerprint: both formats are tracked, but never paired.
    let mut router = Router::new(RouterConfig::new(MODEL, PAGE)).unwrap();
    router.upsert_worker(info(Role::Decode, "d-a", 1)).unwrap();
    router.upsert_worker(info(Role::Prefill, "p-b", 2)).unwrap();
    for i in 0..20 {
        let decision = router
            .decide(&prompt(i * 5000, 4096), WorkerSet::EMPTY)
            .unwrap();
        assert_eq!(decision.reason, Reason::NoPrefillWorkers);
    }
    router.upsert_worker(info(Role::Prefill, "p-a", 1)).unwrap();
    router.upsert_worker(info(Role::Decode, "d-b", 2)).unwrap();
    for i in 0..50 {
        let decision = router
            .decide(&prompt(i * 5000, 4096), WorkerSet::EMPTY)
            .unwrap();
        let prefill = decision.prefill.unwrap();
        assert_eq!(
            prefill.worker.kv_fingerprint,
            decision.decode.worker.kv_fingerprint
        );
    }
}

#[test]
fn other_models_page_sizes_and_routers_are_refused() {
    let mut router = router(&[], &[]);
    let other_model = WorkerInfo {
        model: "llama".into(),
        ..info(Role::Decode, "d0", FP)
    };
    assert!(matches!(
        router.upsert_worker(other_model),
        Err(Error::ModelMismatch { .. })
    ));
    let other_page = WorkerInfo {
        page_size: 32,
        ..info(Role::Decode, "d0", FP)
    };
    assert!(matches!(
        router.upsert_worker(other_page),
        Err(Error::PageSizeMismatch { .. })
    ));
    assert!(matches!(
        router.upsert_worker(info(Role::Router, "r0", FP)),
        Err(Error::NotAWorker { .. })
    ));
    // A discovery stream of all roles may carry routers: ignored.
    router
        .apply_worker_event(WorkerEvent::Added(info(Role::Router, "r0", 0)))
        .unwrap();
    assert!(router.workers().is_empty());
    // A prompt hashed with another page size.
    let ids: Vec<u32> = (0..64).collect();
    router.upsert_worker(info(Role::Decode, "d0", FP)).unwrap();
    assert!(matches!(
        router.decide(&Prompt::new(&ids, 32).unwrap(), WorkerSet::EMPTY),
        Err(Error::PromptPageSize { .. })
    ));
}

#[test]
fn discovery_events_add_update_and_remove_workers() {
    let mut router = router(&[], &[]);
    router
        .apply_worker_event(WorkerEvent::Added(info(Role::Decode, "d0", FP)))
        .unwrap();
    router
        .apply_worker_event(WorkerEvent::Added(info(Role::Prefill, "d0", FP)))
        .unwrap();
    assert_eq!(router.workers().len(), 2, "ids are unique per role");

    let mut updated = info(Role::Decode, "d0", FP);
    updated.addresses.grpc = "10.0.0.1:1".into();
    updated.capacity.free_pages = 5;
    router
        .apply_worker_event(WorkerEvent::Updated(updated))
        .unwrap();
    let status = router.worker(Role::Decode, &id("d0")).unwrap();
    assert_eq!(status.info.addresses.grpc, "10.0.0.1:1");
    assert_eq!(status.load.available_pages, 5);

    let p = prompt(0, 64);
    cache(&mut router, Role::Decode, "d0", &p, 4);
    assert_eq!(router.stats().index_blocks, 4);
    router
        .apply_worker_event(WorkerEvent::Removed {
            role: Role::Decode,
            id: id("d0"),
        })
        .unwrap();
    assert_eq!(router.stats().index_blocks, 0);
    assert_eq!(router.stats().decode_workers, 0);
    assert!(matches!(
        router.apply_kv_events(Role::Decode, &id("d0"), INSTANCE, &[]),
        Err(Error::UnknownWorker { .. })
    ));
    assert!(router.remove_worker(Role::Decode, &id("d0")).is_none());
}

#[test]
fn finishing_releases_load_and_a_reused_slot_is_never_debited() {
    let mut router = router(&["p0"], &["d0"]);
    let p = prompt(0, 2048);
    let routed = router.route(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(routed.decision.reason, Reason::Disaggregated);
    let load = |router: &Router, role, name| router.worker(role, &id(name)).unwrap().load;
    assert_eq!(load(&router, Role::Decode, "d0").own_requests, 1);
    assert_eq!(
        load(&router, Role::Decode, "d0").available_pages,
        10_000 - 128
    );
    assert_eq!(load(&router, Role::Prefill, "p0").own_requests, 1);

    assert!(router.prefill_done(routed.ticket));
    assert!(!router.prefill_done(routed.ticket));
    assert_eq!(load(&router, Role::Prefill, "p0").own_requests, 0);
    assert_eq!(load(&router, Role::Decode, "d0").own_requests, 1);

    // d0 leaves and a new d1 takes its slot; finishing the old request must not touch d1.
    let d1_before = {
        router.remove_worker(Role::Decode, &id("d0"));
        router.upsert_worker(info(Role::Decode, "d1", FP)).unwrap();
        router.route(&p, WorkerSet::EMPTY).unwrap();
        load(&router, Role::Decode, "d1")
    };
    assert!(router.finish(routed.ticket));
    assert!(!router.finish(routed.ticket));
    assert_eq!(load(&router, Role::Decode, "d1"), d1_before);
}

#[test]
fn a_failed_prefill_moves_to_another_prefill_worker() {
    let mut router = router(&["p0", "p1"], &["d0"]);
    let p = prompt(0, 2048);
    let routed = router.route(&p, WorkerSet::EMPTY).unwrap();
    let first = routed.decision.prefill.unwrap();
    let second = router.retry_prefill(routed.ticket, &p).unwrap().unwrap();
    assert_ne!(name(&first), name(&second));
    let own = |router: &Router, placement: &Placement| {
        router
            .worker(Role::Prefill, &placement.worker.id)
            .unwrap()
            .load
            .own_requests
    };
    assert_eq!((own(&router, &first), own(&router, &second)), (0, 1));
    // Both failed: none left.
    assert!(router.retry_prefill(routed.ticket, &p).unwrap().is_none());
    assert_eq!(own(&router, &second), 0);
    assert!(router.finish(routed.ticket));
    assert!(matches!(
        router.retry_prefill(routed.ticket, &p),
        Err(Error::UnknownTicket(_))
    ));
}

#[test]
fn batches_and_snapshots_feed_the_index() {
    let mut router = router(&[], &["d0"]);
    let p = prompt(0, 64);
    let stored = KvEvent {
        id: 3,
        data: KvEventData::Stored {
            parent: None,
            blocks: p.hashes().to_vec(),
        },
    };
    let report = router
        .apply_kv_events(Role::Decode, &id("d0"), 9, &[stored])
        .unwrap();
    assert!(
        report.status.needs_snapshot(),
        "a first event after id 1 is a gap"
    );
    assert!(
        router
            .worker(Role::Decode, &id("d0"))
            .unwrap()
            .needs_snapshot
    );
    let snapshot = KvSnapshot {
        last_event_id: 3,
        blocks: p.hashes().iter().map(|h| (*h, None)).collect(),
    };
    let report = router
        .apply_kv_snapshot(Role::Decode, &id("d0"), 9, &snapshot)
        .unwrap();
    assert_eq!(report.status, SyncStatus::InSync);
    assert_eq!(report.skipped, 1);
    let decision = router.decide(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(decision.decode.cached_tokens, 64);
}

#[test]
fn invalid_configs_are_refused() {
    assert!(Router::new(RouterConfig::new(MODEL, 0)).is_err());
    let mut config = RouterConfig::new(MODEL, PAGE);
    config.policy.request_cost_tokens = f64::INFINITY;
    assert!(Router::new(config).is_err());
}

#[test]
fn too_many_workers_is_an_error() {
    let mut router = router(&[], &[]);
    for i in 0..MAX_WORKERS {
        router
            .upsert_worker(info(Role::Decode, &format!("d{i}"), FP))
            .unwrap();
    }
    assert!(matches!(
        router.upsert_worker(info(Role::Prefill, "one-more", FP)),
        Err(Error::TooManyWorkers { .. })
    ));
}

#[test]
fn unreachable_workers_get_no_requests_until_they_answer() {
    let mut router = router(&[], &["d0", "d1"]);
    let p = prompt(0, 64);
    assert!(router.set_reachable(Role::Decode, &id("d0"), false));
    assert!(
        !router.set_reachable(Role::Decode, &id("d0"), false),
        "no change"
    );
    assert_eq!(router.reachable_decode_workers(), 1);
    assert_eq!(router.stats().unreachable_workers, 1);
    for _ in 0..8 {
        let decision = router.decide(&p, WorkerSet::EMPTY).unwrap();
        assert_eq!(decision.decode.worker.id, id("d1"));
    }
    assert!(router.set_reachable(Role::Decode, &id("d1"), false));
    assert!(matches!(
        router.decide(&p, WorkerSet::EMPTY),
        Err(Error::NoDecodeWorkers)
    ));
    assert!(router.set_reachable(Role::Decode, &id("d0"), true));
    assert_eq!(
        router
            .decide(&p, WorkerSet::EMPTY)
            .unwrap()
            .decode
            .worker
            .id,
        id("d0")
    );
}

#[test]
fn a_draining_worker_gets_no_new_requests() {
    let mut router = router(&["p0", "p1"], &["d0", "d1"]);
    let p = prompt(0, 2048);
    // d0 and p0 hold the whole prompt, but are leaving their roles.
    cache(&mut router, Role::Decode, "d0", &p, 128);
    cache(&mut router, Role::Prefill, "p0", &p, 128);
    for (role, name) in [(Role::Decode, "d0"), (Role::Prefill, "p0")] {
        let draining = WorkerInfo {
            draining: true,
            ..info(role, name, FP)
        };
        router
            .apply_worker_event(WorkerEvent::Updated(draining))
            .unwrap();
    }
    for i in 0..20 {
        let routed = router
            .route(&prompt(i * 10_000, 2048), WorkerSet::EMPTY)
            .unwrap();
        assert_eq!(name(&routed.decision.decode), "d1");
        let prefill = routed.decision.prefill.as_ref().expect("disaggregated");
        assert_eq!(name(prefill), "p1");
    }
    let routed = router.route(&p, WorkerSet::EMPTY).unwrap();
    assert_eq!(
        name(&routed.decision.decode),
        "d1",
        "its cache attracts nothing"
    );
    // Nothing else left: no decode worker to place on.
    let d1 = WorkerInfo {
        draining: true,
        ..info(Role::Decode, "d1", FP)
    };
    router.apply_worker_event(WorkerEvent::Updated(d1)).unwrap();
    assert!(matches!(
        router.decide(&p, WorkerSet::EMPTY),
        Err(Error::NoDecodeWorkers)
    ));
}

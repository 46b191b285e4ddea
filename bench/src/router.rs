//! A seeded router workload: a cluster whose prefix index holds many shared prefixes, and the
//! prompts to route against it.
//!
//! The cluster has `workers_per_role` prefill and as many decode workers. The cached content is
//! chat-like: `system_prompts` system prompts of `system_pages` pages each, and
//! `conversations` conversations, each one system prompt followed by its own pages up to
//! `prompt_pages` in all. Every worker caches every system prompt plus randomly chosen
//! conversations (the last one cut short) until it holds exactly `blocks_per_worker` blocks,
//! so a conversation is typically cached on several workers and the system prompts on all.
//! Everything reaches the index as `Stored` KV events, the way workers report it.
//!
//! Queries are prompts of `prompt_pages` full pages plus a partial one, mixed as a serving
//! cluster sees them: half continue a cached conversation (its first pages, then new ones),
//! three in ten start a new conversation on a cached system prompt, and the rest share nothing.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use nibble_router::{
    BlockHash, Capacity, KvEvent, KvEventData, Prompt, Role, Router, RouterConfig, WorkerId,
    WorkerInfo,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The model name the workload's workers serve.
pub const MODEL: &str = "bench-model";
/// The KV-format fingerprint the workload's workers share.
pub const FINGERPRINT: u64 = 0x6265_6e63_686d_6b76;
/// Token ids are drawn below this (a typical vocabulary).
const VOCAB: u32 = 50_000;
/// The KV-event stream instance every worker uses.
const INSTANCE: u64 = 1;

/// The shape of a workload (see the module docs).
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub workers_per_role: usize,
    pub blocks_per_worker: usize,
    pub page_size: u32,
    pub system_prompts: usize,
    pub system_pages: usize,
    pub conversations: usize,
    pub prompt_pages: usize,
    pub queries: usize,
    pub seed: u64,
}

impl Default for WorkloadConfig {
    /// The benchmark: 16 workers × 100k blocks, prompts of ~2k tokens at page 16.
    fn default() -> Self {
        Self {
            workers_per_role: 8,
            blocks_per_worker: 100_000,
            page_size: 16,
            system_prompts: 64,
            system_pages: 32,
            conversations: 4_000,
            prompt_pages: 128,
            queries: 4_096,
            seed: 42,
        }
    }
}

impl WorkloadConfig {
    /// A small workload of the same shape, for checking that a benchmark runs.
    pub fn smoke_test() -> Self {
        Self {
            workers_per_role: 2,
            blocks_per_worker: 1_000,
            system_prompts: 4,
            system_pages: 8,
            conversations: 100,
            prompt_pages: 32,
            queries: 50,
            ..Self::default()
        }
    }
}

/// A router with a filled index and prompts to route.
pub struct Workload {
    pub router: Router,
    /// Prompts, already hashed, in a random mix.
    pub prompts: Vec<Prompt>,
    /// A few raw prompts (token ids), for measuring hashing.
    pub raw_prompts: Vec<Vec<u32>>,
    /// KV events applied to fill the index.
    pub events: usize,
    /// Blocks those events stored, summed over workers.
    pub stored_blocks: usize,
    /// Time spent applying them.
    pub fill_time: Duration,
}

/// Builds the workload `config` describes.
///
/// # Panics
/// If the configuration cannot be realised (a worker cannot hold the system prompts, or there are
/// too few conversations to fill it).
pub fn workload(config: &WorkloadConfig) -> Workload {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let page = config.page_size as usize;
    let tail_pages = config.prompt_pages - config.system_pages;
    let systems: Vec<Vec<BlockHash>> = (0..config.system_prompts)
        .map(|_| extend(None, config.system_pages, page, &mut rng))
        .collect();
    let conversations: Vec<(usize, Vec<BlockHash>)> = (0..config.conversations)
        .map(|_| {
            let system = rng.gen_range(0..systems.len());
            let parent = systems[system].last().copied();
            (system, extend(parent, tail_pages, page, &mut rng))
        })
        .collect();

    let mut router_config = RouterConfig::new(MODEL, config.page_size);
    router_config.kv_fingerprint = Some(FINGERPRINT);
    let mut router = Router::new(router_config).expect("a valid config");
    let (mut events, mut stored_blocks) = (0, 0);
    let mut fill_time = Duration::ZERO;
    for role in [Role::Prefill, Role::Decode] {
        for w in 0..config.workers_per_role {
            let info = worker(role, w, config.page_size);
            let id = info.id.clone();
            router.upsert_worker(info).expect("a compatible worker");
            let batch = worker_events(config, &systems, &conversations, &mut rng);
            events += batch.len();
            stored_blocks += batch.iter().map(|e| stored_len(&e.data)).sum::<usize>();
            let start = Instant::now();
            router
                .apply_kv_events(role, &id, INSTANCE, &batch)
                .expect("a tracked worker");
            fill_time += start.elapsed();
        }
    }

    let tokens = config.prompt_pages * page + page / 2;
    let prompts = (0..config.queries)
        .map(|_| {
            let kind = rng.gen_range(0..10);
            let hashes = if kind < 5 {
                // Continue a cached conversation: keep most of it, then new turns.
                let (system, tail) = &conversations[rng.gen_range(0..conversations.len())];
                let keep = rng.gen_range(tail.len() / 2..=tail.len());
                let mut hashes = systems[*system].clone();
                hashes.extend_from_slice(&tail[..keep]);
                let parent = hashes.last().copied();
                hashes.extend(extend(parent, tail.len() - keep, page, &mut rng));
                hashes
            } else if kind < 8 {
                // A new conversation on a cached system prompt.
                let mut hashes = systems[rng.gen_range(0..systems.len())].clone();
                let parent = hashes.last().copied();
                hashes.extend(extend(parent, tail_pages, page, &mut rng));
                hashes
            } else {
                extend(None, config.prompt_pages, page, &mut rng)
            };
            Prompt::from_hashes(hashes, tokens, config.page_size).expect("full pages hashed")
        })
        .collect();
    let raw_prompts = (0..64)
        .map(|_| (0..tokens).map(|_| rng.gen_range(0..VOCAB)).collect())
        .collect();
    Workload {
        router,
        prompts,
        raw_prompts,
        events,
        stored_blocks,
        fill_time,
    }
}

/// Adds `count` new prompts of `prompt_pages` full pages that *every* worker caches whole (the
/// longest possible index walk: every worker matches every block), and returns them.
pub fn cached_everywhere(
    router: &mut Router,
    config: &WorkloadConfig,
    count: usize,
) -> Vec<Prompt> {
    let mut rng = StdRng::seed_from_u64(config.seed.rotate_left(17));
    let page = config.page_size as usize;
    let chains: Vec<Vec<BlockHash>> = (0..count)
        .map(|_| extend(None, config.prompt_pages, page, &mut rng))
        .collect();
    for status in router.workers() {
        let last = router
            .index()
            .last_event_id(status.slot)
            .expect("a tracked worker");
        let events: Vec<KvEvent> = chains
            .iter()
            .zip(last + 1..)
            .map(|(blocks, id)| KvEvent {
                id,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: blocks.clone(),
                },
            })
            .collect();
        router
            .apply_kv_events(status.info.role, &status.info.id, INSTANCE, &events)
            .expect("a tracked worker");
    }
    let tokens = config.prompt_pages * page + page / 2;
    chains
        .into_iter()
        .map(|hashes| Prompt::from_hashes(hashes, tokens, config.page_size).expect("full pages"))
        .collect()
}

/// `pages` new pages of random tokens chained after `parent`.
fn extend(
    parent: Option<BlockHash>,
    pages: usize,
    page: usize,
    rng: &mut StdRng,
) -> Vec<BlockHash> {
    let mut parent = parent;
    let mut tokens = vec![0u32; page];
    (0..pages)
        .map(|_| {
            tokens.iter_mut().for_each(|t| *t = rng.gen_range(0..VOCAB));
            let hash = nibble_router::hash_block(parent, &tokens);
            parent = Some(hash);
            hash
        })
        .collect()
}

fn worker(role: Role, index: usize, page_size: u32) -> WorkerInfo {
    WorkerInfo {
        role,
        id: WorkerId::new(format!("{role}-{index}")).expect("a valid id"),
        addresses: Default::default(),
        model: MODEL.into(),
        kv_fingerprint: FINGERPRINT,
        page_size,
        capacity: Capacity {
            free_pages: 100_000,
            total_pages: 200_000,
        },
        nccl: None,
        draining: false,
    }
}

/// One worker's events: every system prompt, then whole conversations, then part of one, to
/// exactly `blocks_per_worker` blocks.
fn worker_events(
    config: &WorkloadConfig,
    systems: &[Vec<BlockHash>],
    conversations: &[(usize, Vec<BlockHash>)],
    rng: &mut StdRng,
) -> Vec<KvEvent> {
    let mut data: Vec<KvEventData> = systems
        .iter()
        .map(|blocks| KvEventData::Stored {
            parent: None,
            blocks: blocks.clone(),
        })
        .collect();
    let mut held = systems.len() * config.system_pages;
    assert!(
        held <= config.blocks_per_worker,
        "system prompts do not fit"
    );
    let mut taken = HashSet::new();
    while held < config.blocks_per_worker {
        assert!(
            taken.len() < conversations.len(),
            "too few conversations to fill a worker"
        );
        let pick = rng.gen_range(0..conversations.len());
        if !taken.insert(pick) {
            continue;
        }
        let (system, tail) = &conversations[pick];
        let n = tail.len().min(config.blocks_per_worker - held);
        data.push(KvEventData::Stored {
            parent: systems[*system].last().copied(),
            blocks: tail[..n].to_vec(),
        });
        held += n;
    }
    data.into_iter()
        .zip(1..)
        .map(|(data, id)| KvEvent { id, data })
        .collect()
}

fn stored_len(data: &KvEventData) -> usize {
    match data {
        KvEventData::Stored { blocks, .. } => blocks.len(),
        KvEventData::Removed { .. } => 0,
    }
}

/// Percentiles of a set of durations in nanoseconds (sorted in place).
pub fn percentiles(samples: &mut [u64], quantiles: &[f64]) -> Vec<u64> {
    samples.sort_unstable();
    quantiles
        .iter()
        .map(|q| {
            let rank = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use nibble_router::WorkerSet;

    use super::*;

    fn small() -> WorkloadConfig {
        WorkloadConfig::smoke_test()
    }

    #[test]
    fn every_worker_holds_exactly_its_blocks() {
        let mut w = workload(&small());
        for status in w.router.workers() {
            assert_eq!(status.blocks, 1_000, "{}", status.info.id);
        }
        assert_eq!(w.stored_blocks, 4 * 1_000);
        assert_eq!(w.prompts.len(), 50);
        let prompt = w.prompts[0].clone();
        assert_eq!(prompt.hashes().len(), 32);
        assert!(w.router.route(&prompt, WorkerSet::EMPTY).is_ok());

        let hot = cached_everywhere(&mut w.router, &small(), 3);
        let decision = w.router.decide(&hot[0], WorkerSet::EMPTY).unwrap();
        assert_eq!(decision.decode.cached_tokens, 32 * 16);
        for status in w.router.workers() {
            assert_eq!(status.blocks, 1_000 + 3 * 32);
            assert!(!status.needs_snapshot);
        }
    }

    #[test]
    fn seeded() {
        let (a, b) = (workload(&small()), workload(&small()));
        assert_eq!(a.prompts, b.prompts);
        assert_eq!(a.router.index().len(), b.router.index().len());
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut samples: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(
            percentiles(&mut samples, &[0.5, 0.99, 1.0]),
            vec![50, 99, 100]
        );
    }
}

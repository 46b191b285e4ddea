use std::collections::HashMap;

use nibble_kvfmt::{interchange, KvDtype, KvPart, ScaleRule};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;
use crate::{GlobalScales, HostPages, PageTable};

fn layout(dtype: KvDtype) -> PageLayout {
    PageLayout::new(2, 2, 32, 4, dtype).unwrap()
}

fn pool(dtype: KvDtype, pages: usize) -> (PagePool, HostPages) {
    let plan = PoolPlan::for_pages(layout(dtype), pages).unwrap();
    (
        PagePool::new(plan),
        HostPages::new(plan, GlobalScales::ones(2), ScaleRule::Amax).unwrap(),
    )
}

#[test]
fn allocated_storage_equals_planned_bytes() {
    for dtype in KvDtype::ALL {
        let layout = PageLayout::new(30, 3, 64, 16, dtype).unwrap();
        let plan = PoolPlan::for_budget(layout, 64 << 20).unwrap();
        let pages = HostPages::new(plan, GlobalScales::ones(30), ScaleRule::Mse).unwrap();
        assert_eq!(pages.storage_bytes(), plan.bytes, "{dtype}");
        assert_eq!(PagePool::new(plan).total_pages(), plan.pages);
        assert_eq!(plan.bytes, plan.pages * layout.page_bytes());
        assert!(plan.bytes <= 64 << 20 && (64 << 20) - plan.bytes < layout.page_bytes());
    }
}

#[test]
fn nvfp4_holds_more_tokens_in_the_same_budget() {
    let budget = 1 << 30;
    let tokens = |d| {
        let layout = PageLayout::new(32, 8, 128, 16, d).unwrap();
        PoolPlan::for_budget(layout, budget).unwrap().tokens()
    };
    let (b, f, n) = (
        tokens(KvDtype::Bf16),
        tokens(KvDtype::Fp8),
        tokens(KvDtype::Nvfp4),
    );
    assert_eq!(f, 2 * b);
    assert!(n as f64 / f as f64 > 1.77, "nvfp4 {n} vs fp8 {f}");
}

#[test]
fn budget_smaller_than_a_page_is_an_error() {
    let err = PoolPlan::for_budget(layout(KvDtype::Nvfp4), 10).unwrap_err();
    assert!(err.to_string().contains("at least one page"), "{err}");
}

#[test]
fn alloc_is_all_or_nothing() {
    let (mut pool, _) = pool(KvDtype::Fp8, 4);
    let a = pool.alloc(3).unwrap();
    assert_eq!(a.len(), 3);
    let err = pool.alloc(2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "KV pool exhausted: 2 pages requested, 1 free of 4"
    );
    assert_eq!(pool.free_pages(), 1);
    pool.release_all(&a).unwrap();
    assert_eq!(pool.free_pages(), 4);
}

#[test]
fn double_free_and_use_after_free_are_errors() {
    let (mut pool, _) = pool(KvDtype::Fp8, 2);
    let p = pool.alloc(1).unwrap()[0];
    pool.retain(p).unwrap();
    assert!(!pool.release(p).unwrap());
    assert!(pool.release(p).unwrap());
    assert_eq!(pool.release(p), Err(Error::NotAllocated(p)));
    assert_eq!(pool.retain(p), Err(Error::NotAllocated(p)));
    assert!(matches!(
        pool.release(PageId(9)),
        Err(Error::PageOutOfRange { .. })
    ));
    pool.check_invariants().unwrap();
}

/// Deterministic K values of token `t` of sequence `seq`.
fn token_values(seq: u64, t: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((seq * 7919 + t as u64 * 131 + i as u64) % 97) as f32 - 48.0) / 8.0)
        .collect()
}

/// Randomized alloc / share / write / free sequences: invariants hold after every step, no live
/// token's bytes are overwritten by another sequence, and the pool drains back to full.
#[test]
fn randomized_sequences_keep_invariants() {
    for dtype in KvDtype::ALL {
        let mut rng = StdRng::seed_from_u64(42);
        let (mut pool, mut store) = pool(dtype, 24);
        let layout = *pool.layout();
        let per_token = layout.kv_heads() * layout.head_dim();
        // Live sequences: (table, id of the sequence that wrote each token).
        let mut live: HashMap<u64, (PageTable, Vec<u64>)> = HashMap::new();
        let mut next_id = 0u64;
        for _step in 0..3000 {
            match rng.gen_range(0..10) {
                0..=4 => {
                    // Append tokens to a new or existing sequence.
                    let id = if live.is_empty() || rng.gen_bool(0.3) {
                        next_id += 1;
                        live.insert(next_id, (PageTable::new(), Vec::new()));
                        next_id
                    } else {
                        *live.keys().nth(rng.gen_range(0..live.len())).unwrap()
                    };
                    let n = rng.gen_range(1..7);
                    let (table, writers) = live.get_mut(&id).unwrap();
                    let start = table.len();
                    match table.append(&mut pool, n) {
                        Ok(slots) => {
                            let mut k = Vec::new();
                            for t in start..start + n {
                                k.extend(token_values(id, t, per_token));
                            }
                            let slots: Vec<_> = slots.into_iter().map(Some).collect();
                            store
                                .write_kv(&pool, rng.gen_range(0..2), &k, &k, &slots)
                                .unwrap();
                            store.write_kv(&pool, 0, &k, &k, &slots).unwrap();
                            writers.extend(std::iter::repeat_n(id, n));
                        }
                        Err(Error::Exhausted { .. }) => assert_eq!(table.len(), start),
                        Err(e) => panic!("{e}"),
                    }
                }
                5..=6 if !live.is_empty() => {
                    // Share the full pages of a sequence with a new one.
                    let src = *live.keys().nth(rng.gen_range(0..live.len())).unwrap();
                    let (table, writers) = &live[&src];
                    let full = table.len() / layout.page_size();
                    let shared = rng.gen_range(0..=full);
                    let pages = table.pages()[..shared].to_vec();
                    let writers = writers[..shared * layout.page_size()].to_vec();
                    let fork = PageTable::from_shared(&mut pool, &pages).unwrap();
                    next_id += 1;
                    live.insert(next_id, (fork, writers));
                }
                7..=9 if !live.is_empty() => {
                    let id = *live.keys().nth(rng.gen_range(0..live.len())).unwrap();
                    let (mut table, _) = live.remove(&id).unwrap();
                    table.release(&mut pool).unwrap();
                }
                _ => {}
            }
            pool.check_invariants().unwrap();
            let held: usize = live.values().map(|(t, _)| t.pages().len()).sum();
            assert!(pool.total_pages() - pool.free_pages() <= held);
        }
        // Every live token still holds what its writer wrote (layer 0, head 0 of K).
        let mut out = vec![0.0f32; layout.head_dim()];
        for (table, writers) in live.values() {
            for (t, writer) in writers.iter().enumerate() {
                let slot = table.slot(t, layout.page_size()).unwrap();
                store.read_head(0, KvPart::K, slot, 0, &mut out).unwrap();
                let x = &token_values(*writer, t, per_token)[..layout.head_dim()];
                let expected = interchange::decode(
                    dtype,
                    layout.head_dim(),
                    1.0,
                    &interchange::encode(dtype, layout.head_dim(), 1.0, x).unwrap(),
                )
                .unwrap();
                assert_eq!(out, expected, "{dtype}: token {t} of writer {writer}");
            }
        }
        for (mut table, _) in live.into_values() {
            table.release(&mut pool).unwrap();
        }
        assert_eq!(pool.free_pages(), pool.total_pages(), "{dtype}: leak");
        pool.check_invariants().unwrap();
    }
}

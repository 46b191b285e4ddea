use nibble_kvfmt::{KvDtype, PageLayout};

use super::*;
use crate::{hash_blocks, PageTable, PoolPlan};

const PAGE: usize = 4;

fn pool(pages: usize) -> PagePool {
    let layout = PageLayout::new(1, 1, 16, PAGE, KvDtype::Nvfp4).unwrap();
    PagePool::new(PoolPlan::for_pages(layout, pages).unwrap())
}

/// Runs a "request": takes the cached prefix, appends the rest, caches its full pages, finishes.
fn serve(cache: &mut RadixCache, pool: &mut PagePool, tokens: &[u32]) -> usize {
    let hashes = hash_blocks(tokens, PAGE);
    let hit = cache.match_prefix(&hashes);
    cache.lock(&hashes[..hit.len()]).unwrap();
    let mut table = PageTable::from_shared(pool, &hit).unwrap();
    table.append(pool, tokens.len() - table.len()).unwrap();
    cache
        .insert(pool, &hashes, &table.pages()[..hashes.len()])
        .unwrap();
    cache.unlock(&hashes[..hit.len()]).unwrap();
    table.release(pool).unwrap();
    hit.len()
}

#[test]
fn match_insert_and_reuse() {
    let mut pool = pool(16);
    let mut cache = RadixCache::default();
    let a: Vec<u32> = (0..10).collect(); // 2 full pages + 2 tokens
    assert_eq!(serve(&mut cache, &mut pool, &a), 0);
    assert_eq!(cache.len(), 2);
    assert_eq!(pool.free_pages(), 14, "the cache keeps the two full pages");
    assert_eq!(serve(&mut cache, &mut pool, &a), 2);
    // A prompt sharing one page branches off it.
    let mut b = a.clone();
    b[5] = 99;
    assert_eq!(serve(&mut cache, &mut pool, &b), 1);
    assert_eq!(cache.len(), 3);
    let stats = cache.stats();
    assert_eq!(
        (stats.queries, stats.query_blocks, stats.hit_blocks),
        (3, 6, 3)
    );
    pool.check_invariants().unwrap();
}

#[test]
fn pages_a_request_still_holds_are_cached_but_not_reclaimable() {
    let mut pool = pool(16);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = hash_blocks(&tokens, PAGE);
    let mut table = PageTable::from_shared(&mut pool, &[]).unwrap();
    table.append(&mut pool, tokens.len()).unwrap();
    cache.insert(&mut pool, &hashes, table.pages()).unwrap();
    // The request is running: its three pages are cached and held.
    assert_eq!((cache.len(), cache.reclaimable(&pool)), (3, 0));
    table.release(&mut pool).unwrap();
    assert_eq!((cache.len(), cache.reclaimable(&pool)), (3, 3));
    // A locked prefix (a request about to reuse it) is not reclaimable either.
    cache.lock(&hashes[..1]).unwrap();
    assert_eq!(cache.reclaimable(&pool), 2);
    cache.unlock(&hashes[..1]).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn a_block_cached_again_moves_to_the_new_copy() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..8).collect();
    let hashes = hash_blocks(&tokens, PAGE);
    let first = pool.alloc(2).unwrap();
    assert_eq!(cache.insert(&mut pool, &hashes, &first).unwrap(), 2);
    assert_eq!(pool.refcount(first[0]).unwrap(), 2);
    // The same two blocks computed again into other pages: nothing new is cached, and the cache
    // now holds the new copies, not both.
    let second = pool.alloc(2).unwrap();
    assert_eq!(cache.insert(&mut pool, &hashes, &second).unwrap(), 0);
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.match_prefix(&hashes), second);
    for (old, new) in first.iter().zip(&second) {
        assert_eq!(pool.refcount(*old).unwrap(), 1, "only its first owner");
        assert_eq!(pool.refcount(*new).unwrap(), 2, "its owner and the cache");
    }
    // The first owner lets go: its copies go back to the pool at once.
    pool.release_all(&first).unwrap();
    assert_eq!(pool.free_pages(), 6);
    // Offering the page the cache already holds changes nothing.
    assert_eq!(
        cache
            .extend(&mut pool, Some(hashes[0]), &hashes[1..], &second[1..])
            .unwrap(),
        0
    );
    assert_eq!(pool.refcount(second[1]).unwrap(), 2);
    let events = cache.drain_events();
    assert_eq!(
        events.len(),
        1,
        "moving a block to another page is no event"
    );
    assert!(matches!(&events[0].data, KvEventData::Stored { blocks, .. } if blocks.len() == 2));
    pool.check_invariants().unwrap();
    let err = cache.insert(&mut pool, &hashes, &second[..1]).unwrap_err();
    assert_eq!(
        err,
        Error::HashPageMismatch {
            hashes: 2,
            pages: 1
        }
    );
}

#[test]
fn evicts_least_recently_used_leaves_first() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (100..108).collect();
    serve(&mut cache, &mut pool, &a);
    serve(&mut cache, &mut pool, &b);
    serve(&mut cache, &mut pool, &a); // a is now the more recent
    assert_eq!(pool.free_pages(), 4);
    assert_eq!(cache.evict(&mut pool, 1).unwrap(), 1);
    let hb = hash_blocks(&b, PAGE);
    assert!(
        cache.contains(hb[0]) && !cache.contains(hb[1]),
        "b's leaf went first"
    );
    // Parents become leaves, and candidates, once their children are gone.
    assert_eq!(cache.evict(&mut pool, 2).unwrap(), 2);
    assert!(!cache.contains(hb[0]));
    let ha = hash_blocks(&a, PAGE);
    assert!(cache.contains(ha[0]) && !cache.contains(ha[1]));
    assert_eq!(pool.free_pages(), 7);
    assert_eq!(cache.evict(&mut pool, 5).unwrap(), 1, "only what is cached");
}

#[test]
fn eviction_skips_locked_blocks_and_their_ancestors() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let a: Vec<u32> = (0..12).collect();
    serve(&mut cache, &mut pool, &a);
    let hashes = hash_blocks(&a, PAGE);
    let pages = cache.match_prefix(&hashes);
    assert_eq!(pages.len(), 3);
    cache.lock(&hashes[..3]).unwrap();
    assert_eq!(cache.evict(&mut pool, 8).unwrap(), 0, "all locked");
    cache.unlock(&hashes[2..3]).unwrap();
    assert_eq!(
        cache.evict(&mut pool, 8).unwrap(),
        1,
        "only the unlocked leaf"
    );
    assert!(cache.contains(hashes[1]));
    assert_eq!(
        cache.unlock(&hashes[2..3]),
        Err(Error::NotLocked(hashes[2]))
    );
    cache.unlock(&hashes[..2]).unwrap();
    assert_eq!(cache.evict(&mut pool, 8).unwrap(), 2);
    assert!(cache.is_empty());
    assert_eq!(pool.free_pages(), pool.total_pages());
}

#[test]
fn eviction_never_frees_a_page_a_sequence_holds() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..8).collect();
    let hashes = hash_blocks(&tokens, PAGE);
    let mut table = PageTable::new();
    table.append(&mut pool, 8).unwrap();
    cache.insert(&mut pool, &hashes, table.pages()).unwrap();
    // Unlocked, but the sequence still holds the pages: nothing to gain, nothing evicted.
    assert_eq!(cache.evict(&mut pool, 2).unwrap(), 0);
    table.release(&mut pool).unwrap();
    assert_eq!(cache.evict(&mut pool, 2).unwrap(), 2);
    assert_eq!(pool.free_pages(), 8);
}

#[test]
fn events_and_snapshot_describe_the_cache() {
    let mut pool = pool(8);
    let mut cache = RadixCache::new(16);
    let a: Vec<u32> = (0..8).collect();
    let mut b = a.clone();
    b[6] = 7777;
    serve(&mut cache, &mut pool, &a);
    serve(&mut cache, &mut pool, &b);
    let (ha, hb) = (hash_blocks(&a, PAGE), hash_blocks(&b, PAGE));
    cache.evict(&mut pool, 1).unwrap();
    let events = cache.drain_events();
    let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![1, 2, 3]);
    assert_eq!(
        events[0].data,
        KvEventData::Stored {
            parent: None,
            blocks: ha.clone()
        }
    );
    assert_eq!(
        events[1].data,
        KvEventData::Stored {
            parent: Some(ha[0]),
            blocks: vec![hb[1]]
        }
    );
    assert!(matches!(&events[2].data, KvEventData::Removed { blocks } if blocks.len() == 1));
    assert!(cache.drain_events().is_empty());
    let snapshot = cache.snapshot();
    assert_eq!(snapshot.last_event_id, 3);
    assert_eq!(snapshot.blocks.len(), 2);
    assert_eq!(snapshot.blocks[0], (ha[0], None), "parents first");
}

#[test]
fn events_after_an_id_are_what_a_consumer_missed_while_the_buffer_holds_them() {
    let mut pool = pool(16);
    let mut cache = RadixCache::new(2);
    assert_eq!(cache.events_after(0), Some(Vec::new()), "nothing yet");
    assert_eq!(cache.events_after(1), None, "an id the cache never gave");
    let serve_at = |cache: &mut RadixCache, pool: &mut PagePool, start: u32| {
        let tokens: Vec<u32> = (start * 100..start * 100 + 4).collect();
        serve(cache, pool, &tokens);
    };
    serve_at(&mut cache, &mut pool, 0);
    serve_at(&mut cache, &mut pool, 1);
    let ids = |events: Vec<KvEvent>| events.iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(cache.events_after(0).map(ids), Some(vec![1, 2]));
    assert_eq!(cache.events_after(1).map(ids), Some(vec![2]));
    assert_eq!(cache.events_after(2).map(ids), Some(vec![]));
    serve_at(&mut cache, &mut pool, 2);
    assert_eq!(cache.events_after(0), None, "event 1 was dropped: resync");
    assert_eq!(cache.events_after(1).map(ids), Some(vec![2, 3]));
    assert_eq!(cache.last_event_id(), 3);
}

#[test]
fn a_deep_chain_snapshots_parents_first() {
    // One long prompt: 20,000 blocks in one chain, plus a branch off its middle. Finding every
    // depth by walking to the root took O(n * depth); each depth is found once now.
    let n = 20_000;
    let mut pool = pool(n + 8);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..(n * PAGE) as u32).collect();
    serve(&mut cache, &mut pool, &tokens);
    let mut branch = tokens[..(n / 2 + 1) * PAGE].to_vec();
    *branch.last_mut().unwrap() = u32::MAX;
    serve(&mut cache, &mut pool, &branch);
    let snapshot = cache.snapshot();
    assert_eq!(snapshot.blocks.len(), n + 1);
    let mut seen = std::collections::HashSet::new();
    for (hash, parent) in &snapshot.blocks {
        assert!(
            parent.is_none_or(|p| seen.contains(&p)),
            "parent before child"
        );
        seen.insert(*hash);
    }
    let hashes = hash_blocks(&tokens, PAGE);
    assert_eq!(snapshot.blocks[0], (hashes[0], None));
    assert_eq!(
        snapshot.blocks[n],
        (hashes[n - 1], Some(hashes[n - 2])),
        "the deepest last"
    );
}

#[test]
fn bounded_event_log_drops_the_oldest() {
    let mut pool = pool(16);
    let mut cache = RadixCache::new(2);
    for start in 0..4u32 {
        let tokens: Vec<u32> = (start * 100..start * 100 + 4).collect();
        serve(&mut cache, &mut pool, &tokens);
    }
    let ids: Vec<u64> = cache.drain_events().iter().map(|e| e.id).collect();
    assert_eq!(
        ids,
        vec![3, 4],
        "a consumer sees the gap after 0 and resyncs"
    );
    assert_eq!(cache.snapshot().last_event_id, 4);
}

#[test]
fn clear_refuses_while_locked_then_releases_everything() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..8).collect();
    serve(&mut cache, &mut pool, &tokens);
    let hashes = hash_blocks(&tokens, PAGE);
    cache.lock(&hashes[..1]).unwrap();
    assert_eq!(cache.clear(&mut pool), Err(Error::Locked(hashes[0])));
    assert_eq!(cache.len(), 2);
    cache.unlock(&hashes[..1]).unwrap();
    cache.clear(&mut pool).unwrap();
    assert_eq!(pool.free_pages(), 8);
}

#[test]
fn extending_a_chain_page_by_page_equals_inserting_it_whole() {
    // A sequence growing to 5 full pages offers each page as it fills (extend), against the
    // whole chain inserted at once: the same blocks, pages and parents, and the same snapshot.
    let tokens: Vec<u32> = (0..5 * PAGE as u32).collect();
    let hashes = hash_blocks(&tokens, PAGE);
    let (mut pool_a, mut pool_b) = (pool(8), pool(8));
    let mut table_a = PageTable::new();
    table_a.append(&mut pool_a, tokens.len()).unwrap();
    let mut table_b = PageTable::new();
    table_b.append(&mut pool_b, tokens.len()).unwrap();
    let (mut whole, mut grown) = (RadixCache::new(16), RadixCache::new(16));
    assert_eq!(
        whole.insert(&mut pool_a, &hashes, table_a.pages()).unwrap(),
        5
    );
    let mut new = 0;
    for i in 0..hashes.len() {
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        new += grown
            .extend(&mut pool_b, parent, &hashes[i..=i], &table_b.pages()[i..=i])
            .unwrap();
    }
    assert_eq!(new, 5);
    assert_eq!(whole.snapshot().blocks, grown.snapshot().blocks);
    for (a, b) in table_a.pages().iter().zip(table_b.pages()) {
        assert_eq!(pool_a.refcount(*a).unwrap(), pool_b.refcount(*b).unwrap());
    }
    // Each page's event names its parent, as the whole insert names the chain's.
    let events = grown.drain_events();
    assert_eq!(events.len(), 5);
    assert_eq!(
        events[3].data,
        KvEventData::Stored {
            parent: Some(hashes[2]),
            blocks: vec![hashes[3]]
        }
    );
    // Offering a page already cached adds nothing.
    assert_eq!(
        grown
            .extend(
                &mut pool_b,
                Some(hashes[3]),
                &hashes[4..],
                &table_b.pages()[4..]
            )
            .unwrap(),
        0
    );
}

#[test]
fn extending_from_an_uncached_block_is_refused() {
    let mut pool = pool(4);
    let mut cache = RadixCache::default();
    let tokens: Vec<u32> = (0..2 * PAGE as u32).collect();
    let hashes = hash_blocks(&tokens, PAGE);
    let mut table = PageTable::new();
    table.append(&mut pool, tokens.len()).unwrap();
    let free = pool.free_pages();
    assert_eq!(
        cache.extend(
            &mut pool,
            Some(hashes[0]),
            &hashes[1..],
            &table.pages()[1..]
        ),
        Err(Error::NotCached(hashes[0]))
    );
    assert!(cache.is_empty());
    assert_eq!(pool.free_pages(), free, "no reference taken");
    assert_eq!(pool.refcount(table.pages()[1]).unwrap(), 1);
}

#[test]
fn touched_blocks_are_evicted_last() {
    let mut pool = pool(8);
    let mut cache = RadixCache::default();
    let a: Vec<u32> = (0..PAGE as u32).collect();
    let b: Vec<u32> = (100..100 + PAGE as u32).collect();
    serve(&mut cache, &mut pool, &a);
    serve(&mut cache, &mut pool, &b);
    // a is older; touching it makes b the least recently used.
    cache.touch(&hash_blocks(&a, PAGE));
    cache.touch(&hash_blocks(&[7u32; PAGE], PAGE)); // not cached: skipped
    assert_eq!(cache.evict(&mut pool, 1).unwrap(), 1);
    assert!(cache.contains(hash_blocks(&a, PAGE)[0]));
    assert!(!cache.contains(hash_blocks(&b, PAGE)[0]));
}

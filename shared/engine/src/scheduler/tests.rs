use std::collections::HashMap;

use nibble_kvcache::PoolPlan;
use nibble_kvfmt::{KvDtype, PageLayout, WindowLayout};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;

const PAGE: usize = 4;

/// A state whose prompt blocks are 64 tokens (16 pages: the tests' prompts are one block)
/// unless `config` asks for others.
fn state(pages: usize, config: SchedulerConfig) -> State {
    let pool = PagePool::new(PoolPlan::for_pages(layout(), pages).unwrap());
    let prefill_block = match config.prefill_block {
        256 => 64,
        b => b,
    };
    let config = SchedulerConfig {
        prefill_block,
        ..config
    };
    State::new(config, pool, RadixCache::default())
}

/// Prompt blocks of one page: every page boundary a chunk boundary and a reusable prefix.
fn paged_blocks() -> SchedulerConfig {
    SchedulerConfig {
        prefill_block: PAGE,
        ..SchedulerConfig::default()
    }
}

fn layout() -> PageLayout {
    PageLayout::new(1, 1, 16, PAGE, KvDtype::Nvfp4).unwrap()
}

/// A state whose sequences keep a recent window of `tokens` (one page per window token here: a
/// 72-byte page holds one 64-byte unit).
fn windowed(pages: usize, config: SchedulerConfig, tokens: usize) -> State {
    state(pages, config).with_window(&WindowLayout::new(&layout(), tokens).unwrap())
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest {
        id: SeqId(id),
        prompt,
        max_tokens,
        stop_tokens: vec![],
        prefill_only: false,
        reuse_prefix: true,
        output: Vec::new(),
    }
}

/// A stand-in for the model: the next token is a function of the whole sequence so far, so any
/// recompute must reproduce it exactly.
fn next_token(tokens: &[u32]) -> u32 {
    tokens
        .iter()
        .fold(7u32, |h, t| h.wrapping_mul(31).wrapping_add(*t))
        % 1000
}

/// Runs one step: checks each item against the sequence, samples where asked.
fn step(state: &mut State) -> (Batch, Vec<(SeqId, Outcome)>) {
    let batch = state.schedule();
    let mut sampled = Vec::new();
    for item in &batch.items {
        let tokens = state.tokens(item.seq).unwrap();
        assert_eq!(&tokens[item.positions.clone()], &item.tokens[..]);
        assert_eq!(item.slots.len(), item.tokens.len());
        let table = state.table(item.seq).unwrap();
        for (p, slot) in item.positions.clone().zip(&item.slots) {
            assert_eq!(table.slot(p, PAGE).unwrap(), *slot, "slot of position {p}");
        }
        if item.sample {
            assert_eq!(item.positions.end, tokens.len());
            sampled.push((item.seq, next_token(tokens)));
        }
    }
    let outcomes = state.complete(&batch, &sampled);
    (batch, outcomes)
}

fn drain(state: &mut State) -> HashMap<SeqId, Vec<u32>> {
    let mut outputs: HashMap<SeqId, Vec<u32>> = HashMap::new();
    for _ in 0..10_000 {
        let (batch, outcomes) = step(state);
        if batch.is_empty() && state.waiting() == 0 {
            break;
        }
        for (id, outcome) in outcomes {
            match outcome {
                Outcome::Token(t) | Outcome::Finished(Some(t), _) | Outcome::Prefilled(t) => {
                    outputs.entry(id).or_default().push(t)
                }
                Outcome::Finished(None, _) => {}
            }
        }
        state.pool.check_invariants().unwrap();
    }
    assert_eq!(state.running() + state.waiting(), 0, "everything finished");
    outputs
}

fn expected_output(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        tokens.push(next_token(&tokens));
    }
    tokens[prompt.len()..].to_vec()
}

fn assert_no_leak(state: &mut State) {
    state.cache.clear(&mut state.pool).unwrap();
    assert_eq!(
        state.pool.free_pages(),
        state.pool.total_pages(),
        "leaked pages"
    );
}

#[test]
fn one_request_prefills_then_decodes() {
    let mut s = state(16, SchedulerConfig::default());
    let prompt: Vec<u32> = (1..=10).collect();
    s.submit(request(1, prompt.clone(), 3)).unwrap();
    let (batch, outcomes) = step(&mut s);
    assert_eq!(batch.items[0].path, Path::Prefill);
    assert_eq!(batch.items[0].positions, 0..10);
    assert!(matches!(outcomes[0].1, Outcome::Token(_)));
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items[0].path, Path::Decode);
    assert_eq!(batch.items[0].positions, 10..11);
    let (_, outcomes) = step(&mut s);
    assert!(matches!(
        outcomes[0].1,
        Outcome::Finished(Some(_), FinishReason::Length)
    ));
    assert_eq!(s.running(), 0);
    // The prompt's full pages stay cached (2 of its 10 tokens' 3 pages); the page its decoded
    // tokens filled is never offered.
    assert_eq!(s.cache.len(), 2);
    assert_no_leak(&mut s);
}

#[test]
fn long_prompts_are_chunked_within_the_budget() {
    let config = SchedulerConfig {
        max_batch_tokens: 4,
        ..Default::default()
    };
    let mut s = state(16, config);
    s.submit(request(1, (0..10).collect(), 1)).unwrap();
    let paths: Vec<(Path, Range<usize>, bool)> = (0..3)
        .map(|_| {
            let (batch, _) = step(&mut s);
            let item = &batch.items[0];
            (item.path, item.positions.clone(), item.sample)
        })
        .collect();
    assert_eq!(
        paths,
        vec![
            (Path::Prefill, 0..4, false),
            (Path::Extend, 4..8, false),
            (Path::Extend, 8..10, true)
        ]
    );
    assert_no_leak(&mut s);
}

#[test]
fn a_cached_prefix_is_reused() {
    let mut s = state(16, paged_blocks());
    let prompt: Vec<u32> = (0..13).collect();
    s.submit(request(1, prompt.clone(), 1)).unwrap();
    drain(&mut s);
    s.submit(request(2, prompt.clone(), 2)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(
        batch.items[0].positions,
        12..13,
        "three cached pages reused"
    );
    assert_eq!(batch.items[0].path, Path::Decode);
    assert_eq!(s.prefix_hit(SeqId(2)), Some(12));
    // A prompt of exactly whole pages still computes its last token.
    let whole: Vec<u32> = (0..8).collect();
    s.submit(request(3, whole, 1)).unwrap();
    let out = drain(&mut s);
    assert_eq!(
        out[&SeqId(3)],
        expected_output(&(0..8).collect::<Vec<_>>(), 1)
    );
    assert_no_leak(&mut s);
}

#[test]
fn a_scoring_request_computes_its_whole_prompt_despite_the_cache() {
    let mut s = state(16, paged_blocks());
    let prompt: Vec<u32> = (0..13).collect();
    s.submit(request(1, prompt.clone(), 1)).unwrap();
    drain(&mut s);
    s.submit(NewRequest {
        reuse_prefix: false,
        ..request(2, prompt.clone(), 1)
    })
    .unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items[0].positions, 0..4, "nothing reused");
    assert_eq!(s.prefix_hit(SeqId(2)), Some(0));
    let out = drain(&mut s);
    assert_eq!(out[&SeqId(2)], expected_output(&prompt, 1));
    assert_no_leak(&mut s);
}

#[test]
fn a_prompts_pages_are_cached_as_one_chain_and_decoded_ones_never() {
    // A 22-token prompt (5 full pages, offered as they fill over 6 one-page blocks) decodes 15
    // tokens across several page boundaries. The cache then holds the prompt's chain, in order
    // (each block's parent the one before), and none of the pages decoding filled: decode
    // computes a token otherwise than a prompt block does, and a later prompt that reused such a
    // page would not get the tokens it gets cold. The same text again reuses the prompt's pages.
    let mut s = state(32, paged_blocks());
    let prompt: Vec<u32> = (0..22).collect();
    s.submit(request(1, prompt.clone(), 15)).unwrap();
    let out = drain(&mut s);
    let chain = hash_blocks(&prompt, PAGE);
    assert_eq!(chain.len(), 5);
    let blocks = s.cache.snapshot().blocks;
    assert_eq!(blocks.len(), chain.len(), "the prompt's pages only");
    for (i, hash) in chain.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| chain[p]);
        assert!(
            blocks.contains(&(*hash, parent)),
            "block {i} and its parent"
        );
    }
    let mut text = prompt.clone();
    text.extend(&out[&SeqId(1)]);
    s.submit(request(2, text.clone(), 1)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(
        batch.items[0].positions.start,
        5 * PAGE,
        "five cached pages reused"
    );
    drain(&mut s);
    assert_no_leak(&mut s);
}

#[test]
fn cached_blocks_are_evicted_for_a_decode_that_needs_their_pages() {
    // Request 1's prompt leaves blocks P, A, B cached in a pool of 4 pages. Request 2 shares P
    // and then decodes into three pages of its own: A and B must be evicted for them, with
    // nobody to preempt.
    let mut s = state(4, paged_blocks());
    let prompt: Vec<u32> = (0..12).collect();
    s.submit(request(1, prompt.clone(), 1)).unwrap();
    drain(&mut s);
    assert_eq!(s.cache.len(), 3, "P, A, B");
    s.submit(request(2, prompt[..5].to_vec(), 10)).unwrap();
    let out = drain(&mut s);
    assert_eq!(out[&SeqId(2)].len(), 10, "request 2 ran to its end");
    assert_eq!(s.preemptions(), 0);
    assert_no_leak(&mut s);
}

#[test]
fn decodes_crossing_a_page_boundary_together_evict_in_one_pass() {
    // A finished request leaves 4 cached blocks and 8 free pages; 4 requests then fill the 8 and
    // cross into their third page in the same step. That step evicts the 4 blocks in one walk of
    // the cache, not one walk per sequence.
    let mut s = state(12, SchedulerConfig::default());
    s.submit(request(100, (0..16).collect(), 1)).unwrap();
    drain(&mut s);
    assert_eq!((s.cache.len(), s.pool.free_pages()), (4, 8));
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|r| (0..6).map(|t| 500 + 10 * r + t).collect())
        .collect();
    for (r, prompt) in prompts.iter().enumerate() {
        s.submit(request(r as u64, prompt.clone(), 4)).unwrap();
    }
    let before = s.cache.stats();
    let out = drain(&mut s);
    let after = s.cache.stats();
    for (r, prompt) in prompts.iter().enumerate() {
        assert_eq!(out[&SeqId(r as u64)], expected_output(prompt, 4));
    }
    assert_eq!(after.evicted_blocks - before.evicted_blocks, 4);
    assert_eq!(after.eviction_scans - before.eviction_scans, 1);
    assert_eq!(s.preemptions(), 0);
    assert_no_leak(&mut s);
}

#[test]
fn admission_waits_for_free_pages() {
    let mut s = state(4, SchedulerConfig::default());
    s.submit(request(1, (0..12).collect(), 2)).unwrap();
    s.submit(request(2, (100..112).collect(), 2)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items.len(), 1, "the second prompt does not fit yet");
    assert_eq!(s.waiting(), 1);
    let out = drain(&mut s);
    assert_eq!(
        out[&SeqId(2)],
        expected_output(&(100..112).collect::<Vec<_>>(), 2)
    );
    assert_no_leak(&mut s);
}

#[test]
fn preemption_recomputes_and_gives_the_same_tokens() {
    // Both prompts fit at first; their decodes do not.
    let mut s = state(5, SchedulerConfig::default());
    let a: Vec<u32> = (0..7).collect();
    let b: Vec<u32> = (50..57).collect();
    s.submit(request(1, a.clone(), 8)).unwrap();
    s.submit(request(2, b.clone(), 8)).unwrap();
    let out = drain(&mut s);
    assert_eq!(out[&SeqId(1)], expected_output(&a, 8));
    assert_eq!(out[&SeqId(2)], expected_output(&b, 8));
    assert!(s.preemptions() > 0, "the test must exercise preemption");
    assert_no_leak(&mut s);
}

#[test]
fn stop_tokens_and_abort() {
    let mut s = state(16, SchedulerConfig::default());
    let prompt: Vec<u32> = (0..5).collect();
    let first = expected_output(&prompt, 1)[0];
    s.submit(NewRequest {
        stop_tokens: vec![first],
        ..request(1, prompt, 10)
    })
    .unwrap();
    let (_, outcomes) = step(&mut s);
    assert_eq!(
        outcomes[0].1,
        Outcome::Finished(Some(first), FinishReason::Stop)
    );
    s.submit(request(2, (0..30).collect(), 10)).unwrap();
    s.submit(request(3, (0..3).collect(), 10)).unwrap();
    step(&mut s);
    assert!(s.abort(SeqId(2)));
    assert!(!s.abort(SeqId(2)));
    assert!(s.abort(SeqId(3)));
    assert_eq!(s.running(), 0);
    assert_no_leak(&mut s);
}

#[test]
fn submissions_are_validated_and_the_queue_is_bounded() {
    let config = SchedulerConfig {
        max_waiting: 2,
        max_context: 64,
        ..Default::default()
    };
    let mut s = state(8, config);
    assert_eq!(
        s.submit(request(1, vec![], 4)),
        Err(SubmitError::EmptyPrompt)
    );
    assert!(matches!(
        s.submit(request(1, vec![1; 60], 10)),
        Err(SubmitError::TooLong(_))
    ));
    assert!(matches!(
        s.submit(request(1, vec![1; 40], 10)),
        Err(SubmitError::TooLarge {
            needed: 13,
            total: 8
        })
    ));
    s.submit(request(1, vec![1; 4], 4)).unwrap();
    assert_eq!(
        s.submit(request(1, vec![1; 4], 4)),
        Err(SubmitError::Duplicate(SeqId(1)))
    );
    s.submit(request(2, vec![1; 4], 4)).unwrap();
    assert_eq!(
        s.submit(request(3, vec![1; 4], 4)),
        Err(SubmitError::QueueFull { waiting: 2 })
    );
}

#[test]
fn randomized_load_finishes_everything_without_leaks() {
    let mut rng = StdRng::seed_from_u64(9);
    for round in 0..40 {
        let config = SchedulerConfig {
            max_batch_tokens: rng.gen_range(4..40),
            max_running: rng.gen_range(1..6),
            max_waiting: 64,
            max_context: 64,
            // One page or two; whole blocks must still fit a step's budget, or wait.
            prefill_block: PAGE * rng.gen_range(1..3),
        };
        // Every other round with a recent window of one page: 4 pages per running sequence.
        let mut s = match round % 2 {
            0 => state(rng.gen_range(12..30), config),
            _ => windowed(rng.gen_range(24..40), config, PAGE),
        };
        let mut prompts = HashMap::new();
        let shared: Vec<u32> = (0..rng.gen_range(0..12)).collect();
        for id in 0..rng.gen_range(1..20u64) {
            let mut prompt = shared.clone();
            prompt.extend((0..rng.gen_range(1..20)).map(|_| rng.gen_range(0..50u32)));
            let n = rng.gen_range(1..12);
            s.submit(request(id, prompt.clone(), n)).unwrap();
            prompts.insert(SeqId(id), (prompt, n));
        }
        let aborted = SeqId(rng.gen_range(0..20));
        let mut outputs: HashMap<SeqId, Vec<u32>> = HashMap::new();
        for t in 0..10_000 {
            if t == 3 {
                s.abort(aborted);
            }
            let (batch, outcomes) = step(&mut s);
            for (id, outcome) in outcomes {
                if let Outcome::Token(tok) | Outcome::Finished(Some(tok), _) = outcome {
                    outputs.entry(id).or_default().push(tok);
                }
            }
            s.pool.check_invariants().unwrap();
            if batch.is_empty() && s.waiting() == 0 {
                break;
            }
        }
        assert_eq!(s.running() + s.waiting(), 0, "round {round}");
        for (id, (prompt, n)) in &prompts {
            if *id == aborted {
                continue;
            }
            assert_eq!(
                outputs[id],
                expected_output(prompt, *n),
                "round {round} {id:?}"
            );
        }
        assert_no_leak(&mut s);
    }
}

#[test]
fn prefill_only_holds_pages_and_reservations_activate() {
    let mut s = state(16, SchedulerConfig::default());
    let prompt: Vec<u32> = (0..21).collect();
    s.submit(NewRequest {
        prefill_only: true,
        ..request(1, prompt.clone(), 5)
    })
    .unwrap();
    let (_, outcomes) = step(&mut s);
    let first = next_token(&prompt);
    assert_eq!(outcomes, vec![(SeqId(1), Outcome::Prefilled(first))]);
    assert_eq!((s.running(), s.held()), (0, 1));
    assert_eq!(
        s.table(SeqId(1)).unwrap().len(),
        21,
        "pages cover the prompt"
    );
    assert!(s.release_held(SeqId(1)));
    // A decode-side reservation reuses the cached full pages and allocates the rest.
    let r = s.reserve(SeqId(2), &prompt).unwrap();
    assert_eq!(r.cached_tokens, 20);
    assert_eq!(r.pages.len(), 6);
    assert_eq!(
        s.reserve(SeqId(2), &prompt),
        Err(SubmitError::Duplicate(SeqId(2)))
    );
    assert_eq!(s.activate(SeqId(2), &[first], 3, vec![]), Ok(None));
    let out = drain(&mut s);
    let mut expected = vec![first];
    expected.extend(expected_output(&[prompt.clone(), vec![first]].concat(), 2));
    assert_eq!(out[&SeqId(2)], expected[1..]);
    assert_eq!(
        s.activate(SeqId(3), &[1], 3, vec![]),
        Err(SubmitError::Unknown(SeqId(3)))
    );
    // A first token that is a stop token ends the request at once.
    s.reserve(SeqId(4), &prompt).unwrap();
    assert_eq!(
        s.activate(SeqId(4), &[9], 3, vec![9]),
        Ok(Some(FinishReason::Stop))
    );
    assert_no_leak(&mut s);
}

#[test]
fn a_window_takes_pages_and_the_cached_prefix_stops_before_it() {
    let blocks = SchedulerConfig {
        prefill_block: 16,
        ..SchedulerConfig::default()
    };
    let mut s = windowed(32, blocks, 4);
    assert_eq!(s.window_pages(), 4);
    let prompt: Vec<u32> = (0..21).collect();
    s.submit(request(1, prompt.clone(), 2)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items[0].positions, 0..16);
    assert_eq!(s.window(SeqId(1)).unwrap().len(), 4);
    // 4 pages of tokens and 4 of window.
    assert_eq!(s.pool.free_pages(), 32 - 4 - 4);
    drain(&mut s);
    // The same prompt again: 5 full pages are cached, but the last 4 tokens before the final one
    // (positions 16..20) must be computed again for the window, so only 4 pages (16 tokens) are
    // reused, not 5.
    s.submit(request(2, prompt.clone(), 2)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items[0].positions, 16..21);
    assert_eq!(batch.items[0].path, Path::Extend);
    assert_eq!(s.prefix_hit(SeqId(2)), Some(16));
    drain(&mut s);
    // A prompt no longer than the window reuses nothing.
    s.submit(request(3, (0..5).collect(), 1)).unwrap();
    let (batch, _) = step(&mut s);
    assert_eq!(batch.items[0].positions, 0..5);
    drain(&mut s);
    // A request needing more pages than the pool has beside its window is refused at once.
    let err = s.submit(request(4, (0..100).collect(), 13)).unwrap_err();
    assert_eq!(
        err,
        SubmitError::TooLarge {
            needed: 33,
            total: 32
        }
    );
    assert_no_leak(&mut s);
}

#[test]
fn reservations_list_the_window_pages_after_the_prompt() {
    let mut s = windowed(32, SchedulerConfig::default(), 4);
    let prompt: Vec<u32> = (0..10).collect();
    let r = s.reserve(SeqId(1), &prompt).unwrap();
    assert_eq!(r.cached_tokens, 0);
    assert_eq!(
        r.pages.len(),
        3 + 4,
        "three prompt pages, then four window pages"
    );
    assert_eq!(&r.pages[3..], s.window(SeqId(1)).unwrap());
    assert_eq!(s.pool.free_pages(), 32 - 7);
    assert!(s.release_held(SeqId(1)));
    assert_eq!(s.pool.free_pages(), 32);
    // No room for the window: nothing is held.
    let mut tight = windowed(5, SchedulerConfig::default(), 4);
    let err = tight.reserve(SeqId(2), &prompt).unwrap_err();
    assert!(matches!(err, SubmitError::TooLarge { .. }), "{err}");
    let mut tight = windowed(8, SchedulerConfig::default(), 4);
    tight.submit(request(3, (0..4).collect(), 8)).unwrap();
    step(&mut tight);
    let err = tight.reserve(SeqId(4), &prompt).unwrap_err();
    assert!(matches!(err, SubmitError::NoRoom { .. }), "{err}");
    assert_eq!(tight.held(), 0);
    drain(&mut tight);
    assert_no_leak(&mut tight);
}

#[test]
fn prompts_run_in_whole_blocks_and_reuse_stops_at_a_block_boundary() {
    // Blocks of 8 tokens (two pages) and a step budget of 12: a 21-token prompt runs as 0..8,
    // 8..16, 16..21, never a split block.
    let config = SchedulerConfig {
        max_batch_tokens: 12,
        max_running: 2,
        prefill_block: 8,
        ..SchedulerConfig::default()
    };
    let mut s = state(32, config);
    assert_eq!(s.prefill_block(), 8);
    let prompt: Vec<u32> = (0..21).collect();
    let mut chunks = Vec::new();
    for id in [1, 2] {
        s.submit(request(id, prompt.clone(), 6)).unwrap();
        while s.running() + s.waiting() > 0 {
            let (batch, _) = step(&mut s);
            for item in batch.items.iter().filter(|i| i.path != Path::Decode) {
                assert!(item.tokens.len() <= 8, "{item:?}");
                chunks.push(item.positions.clone());
            }
        }
    }
    // Request 2 finds request 1's five full pages but reuses only the two whole blocks (16
    // tokens), then computes the last block as request 1 did.
    assert_eq!(chunks, vec![0..8, 8..16, 16..21, 16..21]);
    // Two prompts at once: the second's first block waits while the first's takes the budget.
    s.submit(request(3, (100..121).collect(), 1)).unwrap();
    s.submit(request(4, (200..221).collect(), 1)).unwrap();
    let (batch, _) = step(&mut s);
    let sizes: Vec<usize> = batch.items.iter().map(|i| i.tokens.len()).collect();
    assert_eq!(sizes, vec![8], "8 + 8 would pass the budget of 12");
    drain(&mut s);
    assert_no_leak(&mut s);
}

#[test]
fn the_prefill_backlog_counts_prompt_tokens_still_to_compute() {
    let config = SchedulerConfig {
        max_batch_tokens: 8,
        max_running: 1,
        ..paged_blocks()
    };
    let mut s = state(64, config);
    assert_eq!(s.prefill_backlog(), 0);
    let shared: Vec<u32> = (0..12).collect();
    s.submit(request(1, shared.clone(), 1)).unwrap();
    assert_eq!(s.prefill_backlog(), 12);
    // Admission computes its first one-page block.
    step(&mut s);
    assert_eq!(s.prefill_backlog(), 8);
    drain(&mut s);
    assert_eq!(s.prefill_backlog(), 0);
    // A decoding sequence owes none; a waiting prompt only what the cache lacks: 12 of these 14
    // tokens are cached (the first prompt's three full pages).
    s.submit(request(2, vec![500; 6], 4)).unwrap();
    step(&mut s);
    assert_eq!(s.prefill_backlog(), 2);
    step(&mut s);
    assert_eq!(s.prefill_backlog(), 0);
    let mut longer = shared.clone();
    longer.extend([90, 91]);
    s.submit(request(3, longer, 1)).unwrap();
    assert_eq!((s.running(), s.waiting()), (1, 1));
    assert_eq!(s.prefill_backlog(), 2);
    // Without prefix reuse it is the whole prompt.
    s.submit(NewRequest {
        reuse_prefix: false,
        ..request(4, shared, 1)
    })
    .unwrap();
    assert_eq!(s.prefill_backlog(), 2 + 12);
    drain(&mut s);
    assert_no_leak(&mut s);
}

#[test]
fn a_resumed_request_replays_its_output_through_decode_and_continues_exactly() {
    let prompt: Vec<u32> = (0..21).collect();
    let undisturbed = expected_output(&prompt, 8);
    // Locally: the prompt in blocks, then the 3 tokens already streamed one at a time.
    let mut s = state(32, SchedulerConfig::default());
    s.submit(NewRequest {
        output: undisturbed[..3].to_vec(),
        ..request(1, prompt.clone(), 8)
    })
    .unwrap();
    let mut out = Vec::new();
    while s.running() + s.waiting() > 0 {
        let (batch, outcomes) = step(&mut s);
        for item in batch
            .items
            .iter()
            .filter(|i| i.positions.end > prompt.len())
        {
            assert_eq!(
                (item.path, item.tokens.len()),
                (Path::Decode, 1),
                "{item:?}"
            );
            let replayed = item.positions.end < prompt.len() + 3;
            assert_eq!(item.sample, !replayed, "{item:?}");
        }
        for (_, outcome) in outcomes {
            match outcome {
                Outcome::Token(t) | Outcome::Finished(Some(t), _) => out.push(t),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(out, undisturbed[3..]);
    // Over a reservation (the prompt's pages from a prefill worker): the same.
    s.reserve(SeqId(2), &prompt).unwrap();
    assert_eq!(s.activate(SeqId(2), &undisturbed[..5], 8, vec![]), Ok(None));
    assert_eq!(drain(&mut s)[&SeqId(2)], undisturbed[5..]);
    // Output that already ends the request: refused, nothing held.
    let done = NewRequest {
        output: undisturbed.clone(),
        ..request(3, prompt.clone(), 8)
    };
    assert_eq!(s.submit(done), Err(SubmitError::Finished(SeqId(3))));
    s.reserve(SeqId(4), &prompt).unwrap();
    assert_eq!(
        s.activate(SeqId(4), &undisturbed, 8, vec![]),
        Ok(Some(FinishReason::Length))
    );
    assert_no_leak(&mut s);
}

#[test]
fn a_preempted_resumed_request_replays_its_output_again() {
    // As `preemption_recomputes_and_gives_the_same_tokens`, the newest being a resumed request.
    let mut s = state(5, SchedulerConfig::default());
    let a: Vec<u32> = (0..7).collect();
    let b: Vec<u32> = (50..57).collect();
    let resumed = expected_output(&b, 8);
    s.submit(request(1, a.clone(), 8)).unwrap();
    s.submit(NewRequest {
        output: resumed[..2].to_vec(),
        ..request(2, b.clone(), 8)
    })
    .unwrap();
    let out = drain(&mut s);
    assert_eq!(out[&SeqId(1)], expected_output(&a, 8));
    assert_eq!(out[&SeqId(2)], resumed[2..]);
    assert!(s.preemptions() > 0, "the test must exercise preemption");
    assert_no_leak(&mut s);
}

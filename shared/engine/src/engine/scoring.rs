//! Scoring a prompt: the log-probability of each prompt token after the first, from the raw
//! logits of the position before it, for a request that asks for `prompt_logprobs`.
//!
//! Such a request computes its whole prompt (the scheduler gives it no cached prefix), so each
//! prompt chunk's step has logits for every row of that chunk
//! ([`Logits::Select`](crate::model::Logits)); row `r`
//! of a chunk starting at position `s` predicts the token at `s + r + 1`. Each position is scored
//! once, in order, even when a preempted sequence computes its prompt again.

use crate::sampling::{prompt_logprobs, TokenLogprobs};

/// One request's scoring state.
#[derive(Debug)]
pub(super) struct Scoring {
    /// Alternatives per position.
    k: u32,
    /// The next prompt position to score (position 0 has nothing before it).
    next: usize,
    /// Scored (token, log-probabilities) not yet reported.
    pending: Vec<(u32, TokenLogprobs)>,
    scratch: Vec<(u32, f32)>,
}

impl Scoring {
    pub(super) fn new(k: u32) -> Self {
        Self {
            k,
            next: 1,
            pending: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Whether a chunk starting at `start` may hold rows this request still needs.
    pub(super) fn needs(&self, start: usize, prompt_len: usize) -> bool {
        self.next < prompt_len && start < prompt_len
    }

    /// Scores the prompt tokens that `rows` (a chunk's logits, `vocab` per row, from position
    /// `start`) predict; `tokens` is the sequence (prompt first).
    pub(super) fn score(
        &mut self,
        rows: &[f32],
        vocab: usize,
        start: usize,
        tokens: &[u32],
        prompt_len: usize,
    ) {
        for (r, row) in rows.chunks_exact(vocab).enumerate() {
            let target = start + r + 1;
            if target != self.next || target >= prompt_len {
                continue;
            }
            let token = tokens[target];
            let logprobs = prompt_logprobs(row, token, self.k, &mut self.scratch);
            self.pending.push((token, logprobs));
            self.next += 1;
        }
    }

    /// What was scored since the last call.
    pub(super) fn take(&mut self) -> Vec<(u32, TokenLogprobs)> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_prompt_position_is_scored_once_in_order() {
        let vocab = 3;
        // Rows predicting positions 1..=4 of a 4-token prompt plus one output token.
        let rows: Vec<f32> = (0..4 * vocab).map(|i| (i % 5) as f32).collect();
        let tokens = [0u32, 1, 2, 0, 2];
        let mut s = Scoring::new(1);
        assert!(s.needs(0, 4));
        s.score(&rows[..2 * vocab], vocab, 0, &tokens, 4);
        s.score(&rows[..2 * vocab], vocab, 0, &tokens, 4); // recomputed: nothing new
        let first = s.take();
        assert_eq!(first.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 2]);
        s.score(&rows[2 * vocab..], vocab, 2, &tokens, 4);
        let rest = s.take();
        assert_eq!(rest.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0]);
        assert!(!s.needs(3, 4));
        let row = &rows[2 * vocab..3 * vocab];
        let expected = prompt_logprobs(row, 0, 1, &mut Vec::new());
        assert_eq!(rest[0].1, expected);
    }
}

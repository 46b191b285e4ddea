use super::*;

fn samplers(n: usize) -> Vec<Sampler> {
    (0..n)
        .map(|i| {
            Sampler::new(SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(i as u64),
                logprobs: true,
                top_logprobs: 2,
                ..SamplingParams::greedy(8)
            })
        })
        .collect()
}

/// Spread over threads or not, every row gets what its sampler alone would draw, in order.
#[test]
fn rows_sampled_on_threads_match_one_by_one() {
    let (n, vocab) = (37, 500);
    let logits: Vec<f32> = (0..n * vocab)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let seen = [1u32, 2, 3];
    for rounds in 0..3 {
        let (mut threaded, mut alone) = (samplers(n), samplers(n));
        let mut rows = logits.clone();
        let mut expected = Vec::new();
        for _ in 0..=rounds {
            let work: Vec<_> = threaded
                .iter_mut()
                .zip(rows.chunks_exact_mut(vocab))
                .enumerate()
                .map(|(i, (s, row))| (SeqId(i as u64), s, row, &seen[..]))
                .collect();
            let got = sample_rows(work);
            expected.clear();
            for (i, (s, row)) in alone.iter_mut().zip(logits.chunks(vocab)).enumerate() {
                let mut row = row.to_vec();
                expected.push((SeqId(i as u64), s.sample(&mut row, &seen)));
            }
            assert_eq!(got.len(), n);
            for ((gi, g), (ei, e)) in got.iter().zip(&expected) {
                assert_eq!(gi, ei);
                assert_eq!(g.token, e.token, "row {gi:?}");
                assert_eq!(
                    g.logprobs.as_ref().map(|l| l.logprob),
                    e.logprobs.as_ref().map(|l| l.logprob)
                );
            }
            rows.copy_from_slice(&logits);
        }
    }
}

use super::*;

fn logits() -> Vec<f32> {
    vec![1.0, 3.0, 2.0, -1.0, 2.5]
}

fn counts(params: SamplingParams, draws: usize) -> Vec<usize> {
    let mut sampler = Sampler::new(params);
    let mut counts = vec![0; 5];
    for _ in 0..draws {
        counts[sampler.sample(&mut logits(), &[]).token as usize] += 1;
    }
    counts
}

#[test]
fn greedy_takes_the_argmax() {
    let mut sampler = Sampler::new(SamplingParams::greedy(4));
    assert_eq!(sampler.sample(&mut logits(), &[]).token, 1);
}

#[test]
fn logprob_is_under_the_raw_distribution() {
    let params = SamplingParams {
        logprobs: true,
        repetition_penalty: 2.0,
        ..SamplingParams::greedy(4)
    };
    let mut sampler = Sampler::new(params);
    let x = logits();
    let s = sampler.sample(&mut x.clone(), &[1]);
    // The penalty halves token 1's logit to 1.5, so token 4 (2.5) wins.
    assert_eq!(s.token, 4);
    let total: f32 = x.iter().map(|v| v.exp()).sum();
    let expected = (x[4].exp() / total).ln();
    assert!((s.logprobs.unwrap().logprob - expected).abs() < 1e-5);
}

fn with_top(top_logprobs: u32, params: SamplingParams) -> SamplingParams {
    SamplingParams {
        logprobs: true,
        top_logprobs,
        ..params
    }
}

/// log-softmax in f64, straight from the definition.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let total: f64 = x.iter().map(|v| (*v as f64).exp()).sum();
    x.iter().map(|v| *v as f64 - total.ln()).collect()
}

#[test]
fn alternatives_are_the_most_likely_tokens_in_descending_order() {
    let x = logits();
    let mut sampler = Sampler::new(with_top(3, SamplingParams::greedy(4)));
    let s = sampler.sample(&mut x.clone(), &[]);
    let lp = s.logprobs.unwrap();
    let tokens: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, vec![1, 4, 2]);
    let direct = log_softmax(&x);
    for t in &lp.top {
        assert!(
            (t.logprob as f64 - direct[t.token as usize]).abs() < 1e-5,
            "{t:?}"
        );
        assert!(t.logprob <= 0.0);
    }
    assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
    // Greedy: the chosen token is the first alternative, with the very same value.
    assert_eq!(s.token, lp.top[0].token);
    assert_eq!(lp.logprob, lp.top[0].logprob);
}

#[test]
fn a_sampled_tokens_logprob_is_its_entry_among_the_alternatives() {
    let mut sampler = Sampler::new(with_top(
        5,
        SamplingParams {
            seed: Some(9),
            ..SamplingParams::default()
        },
    ));
    let mut chosen = std::collections::HashSet::new();
    for _ in 0..200 {
        let s = sampler.sample(&mut logits(), &[]);
        let lp = s.logprobs.unwrap();
        // k = the whole vocabulary: every draw is among the alternatives.
        let entry = lp.top.iter().find(|t| t.token == s.token).expect("listed");
        assert_eq!(entry.logprob, lp.logprob);
        chosen.insert(s.token);
    }
    assert!(chosen.len() > 1, "sampling chose more than the argmax");
}

#[test]
fn k_past_the_vocabulary_lists_it_all_and_zero_lists_none() {
    let x = logits();
    let mut sampler = Sampler::new(with_top(20, SamplingParams::greedy(4)));
    let lp = sampler.sample(&mut x.clone(), &[]).logprobs.unwrap();
    let tokens: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, vec![1, 4, 2, 0, 3]);
    let total: f64 = lp.top.iter().map(|t| (t.logprob as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");

    let mut sampler = Sampler::new(with_top(0, SamplingParams::greedy(4)));
    let lp = sampler.sample(&mut x.clone(), &[]).logprobs.unwrap();
    assert!(lp.top.is_empty());
    assert!((lp.logprob as f64 - log_softmax(&x)[1]).abs() < 1e-5);
    // Without logprobs nothing is computed.
    let mut sampler = Sampler::new(SamplingParams::greedy(4));
    assert_eq!(sampler.sample(&mut x.clone(), &[]).logprobs, None);
}

#[test]
fn ties_are_listed_in_token_order() {
    let x = vec![0.5, 2.0, 1.0, 2.0, 1.0, 2.0];
    let mut sampler = Sampler::new(with_top(4, SamplingParams::greedy(4)));
    let s = sampler.sample(&mut x.clone(), &[]);
    let tokens: Vec<u32> = s.logprobs.unwrap().top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, vec![1, 3, 5, 2]);
    assert_eq!(s.token, 1, "argmax breaks the tie the same way");
}

#[test]
fn alternatives_match_a_full_sort_over_a_large_vocabulary() {
    // A vocabulary the size of SmolLM2's, with many exact ties (logits on a 1/8 grid).
    let mut rng = StdRng::seed_from_u64(4);
    let x: Vec<f32> = (0..49_152)
        .map(|_| (rng.gen_range(-80..80) as f32) / 8.0)
        .collect();
    let direct = log_softmax(&x);
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.sort_by(|a, b| x[*b as usize].total_cmp(&x[*a as usize]).then(a.cmp(b)));
    let mut sampler = Sampler::new(with_top(20, SamplingParams::greedy(4)));
    let lp = sampler.sample(&mut x.clone(), &[]).logprobs.unwrap();
    let tokens: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, order[..20]);
    for t in &lp.top {
        assert!(
            (t.logprob as f64 - direct[t.token as usize]).abs() < 1e-4,
            "{t:?}"
        );
    }
}

#[test]
fn alternatives_ignore_the_repetition_penalty() {
    let x = logits();
    let params = with_top(
        2,
        SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy(4)
        },
    );
    let s = Sampler::new(params).sample(&mut x.clone(), &[1]);
    // The penalty made token 4 the choice; the model's distribution still ranks token 1 first.
    assert_eq!(s.token, 4);
    let lp = s.logprobs.unwrap();
    let tokens: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
    assert_eq!(tokens, vec![1, 4]);
    assert_eq!(lp.logprob, lp.top[1].logprob);
    assert!((lp.top[0].logprob as f64 - log_softmax(&x)[1]).abs() < 1e-5);
}

#[test]
fn repetition_penalty_applies_once_per_distinct_token() {
    let mut sampler = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy(4)
    });
    let mut x = logits();
    sampler.sample(&mut x, &[1, 1, 1, 3]);
    assert_eq!(x, vec![1.0, 1.5, 2.0, -2.0, 2.5]);
}

#[test]
fn top_k_1_is_greedy_and_seed_repeats() {
    let c = counts(
        SamplingParams {
            top_k: Some(1),
            seed: Some(3),
            ..SamplingParams::default()
        },
        200,
    );
    assert_eq!(c[1], 200);
    let params = SamplingParams {
        seed: Some(11),
        ..SamplingParams::default()
    };
    assert_eq!(counts(params.clone(), 300), counts(params, 300));
}

#[test]
fn top_p_and_min_p_cut_the_tail() {
    // Probabilities ∝ e^x: token 1 ≈ 0.43, 4 ≈ 0.26, 2 ≈ 0.16, 0 ≈ 0.06, 3 ≈ 0.01.
    let c = counts(
        SamplingParams {
            top_p: 0.6,
            seed: Some(1),
            ..SamplingParams::default()
        },
        2000,
    );
    assert!(c[1] > 0 && c[4] > 0, "{c:?}");
    assert_eq!(c[0] + c[2] + c[3], 0, "{c:?}");
    let c = counts(
        SamplingParams {
            min_p: 0.3,
            seed: Some(1),
            ..SamplingParams::default()
        },
        2000,
    );
    assert_eq!(c[0] + c[3], 0, "{c:?}");
    assert!(c[2] > 0, "{c:?}");
}

#[test]
fn temperature_sharpens() {
    let cold = counts(
        SamplingParams {
            temperature: 0.2,
            seed: Some(5),
            ..SamplingParams::default()
        },
        2000,
    );
    let warm = counts(
        SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..SamplingParams::default()
        },
        2000,
    );
    assert!(cold[1] > warm[1], "{cold:?} vs {warm:?}");
    assert!(cold[1] > 1800);
}

#[test]
fn validation_names_the_field() {
    let bad = |p: SamplingParams| p.validate().unwrap_err().to_string();
    assert_eq!(
        bad(SamplingParams {
            max_tokens: 0,
            ..Default::default()
        }),
        "max_tokens must be between 1 and 32768 (0 only to score the prompt), got 0"
    );
    assert_eq!(
        bad(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }),
        "top_p must be in (0, 1], got 0"
    );
    let field = |p: SamplingParams| p.validate().unwrap_err().field;
    assert_eq!(
        field(SamplingParams {
            min_p: 1.0,
            ..Default::default()
        }),
        Param::MinP
    );
    assert_eq!(
        field(SamplingParams {
            stop: vec!["x".into(); MAX_STOP_STRINGS + 1],
            ..Default::default()
        }),
        Param::Stop
    );
    assert_eq!(
        field(SamplingParams {
            stop: vec!["y".repeat(MAX_STOP_BYTES + 1)],
            ..Default::default()
        }),
        Param::Stop
    );
    assert_eq!(
        field(SamplingParams {
            stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
            ..Default::default()
        }),
        Param::StopTokenIds
    );
    let stops = SamplingParams {
        stop_token_ids: vec![3, 49_152],
        ..Default::default()
    };
    assert_eq!(
        stops.check_vocab(49_152).unwrap_err().field,
        Param::StopTokenIds
    );
    assert!(stops.check_vocab(49_153).is_ok());
    assert!(super::check_context(100, 28, 128).is_ok());
    assert_eq!(
        super::check_context(100, 29, 128).unwrap_err().field,
        Param::Prompt
    );
    assert!(
        super::check_context(100_000, 1, 0).is_ok(),
        "0: context unknown"
    );
    assert!(SamplingParams {
        temperature: f32::NAN,
        ..Default::default()
    }
    .validate()
    .is_err());
    assert!(SamplingParams::default().validate().is_ok());
    assert_eq!(
        bad(with_top(21, SamplingParams::default())),
        "top_logprobs must be at most 20, got 21"
    );
    assert_eq!(
        bad(SamplingParams {
            top_logprobs: 2,
            ..Default::default()
        }),
        "top_logprobs must be 0 unless logprobs is set, got 2"
    );
    assert!(with_top(20, SamplingParams::default()).validate().is_ok());
}

#[test]
fn penalties_biases_and_scoring_are_checked_by_name() {
    let field = |p: SamplingParams| p.validate().unwrap_err().field;
    let scoring = SamplingParams {
        max_tokens: 0,
        prompt_logprobs: Some(3),
        ..Default::default()
    };
    assert!(scoring.validate().is_ok(), "max_tokens 0 scores the prompt");
    assert_eq!(
        field(SamplingParams {
            prompt_logprobs: Some(21),
            ..scoring.clone()
        }),
        Param::PromptLogprobs
    );
    for bad in [2.5, -2.01, f32::NAN] {
        assert_eq!(
            field(SamplingParams {
                presence_penalty: bad,
                ..Default::default()
            }),
            Param::PresencePenalty
        );
        assert_eq!(
            field(SamplingParams {
                frequency_penalty: bad,
                ..Default::default()
            }),
            Param::FrequencyPenalty
        );
    }
    let biased = |logit_bias: Vec<(u32, f32)>| SamplingParams {
        logit_bias,
        ..Default::default()
    };
    assert!(biased(vec![(1, 100.0), (2, -100.0)]).validate().is_ok());
    assert_eq!(field(biased(vec![(1, 100.5)])), Param::LogitBias);
    assert_eq!(field(biased(vec![(1, 1.0), (1, 2.0)])), Param::LogitBias);
    let many = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect();
    assert_eq!(field(biased(many)), Param::LogitBias);
    let e = biased(vec![(3, 1.0), (49_152, 1.0)])
        .check_vocab(49_152)
        .unwrap_err();
    assert_eq!(e.field, Param::LogitBias);
    assert_eq!(
        e.to_string(),
        "logit_bias must be token ids below the vocabulary size 49152, got 49152"
    );
}

/// The argmax the backends reproduce: the first largest value; NaNs never win unless first.
#[test]
fn argmax_takes_the_first_largest_and_skips_nans() {
    use super::argmax;
    assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 5.0, 6.0]), 0);
    assert_eq!(argmax(&[1.0, f32::NAN, 0.5]), 0);
    assert_eq!(argmax(&[0.0, f32::NAN, 0.5]), 2);
    assert_eq!(argmax(&[f32::NEG_INFINITY; 4]), 0);
    assert_eq!(argmax(&[-1.0, f32::INFINITY, f32::INFINITY]), 1);
    assert_eq!(argmax(&[]), 0);
}

#[test]
fn a_sampler_that_skips_draws_continues_the_seeded_stream() {
    let params = SamplingParams {
        seed: Some(7),
        ..SamplingParams::default()
    };
    let draw = |sampler: &mut Sampler, n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| sampler.sample(&mut logits(), &[]).token)
            .collect()
    };
    let whole = draw(&mut Sampler::new(params.clone()), 40);
    // Another engine drew the first 15 tokens; this one continues where it left off.
    let resumed = draw(&mut Sampler::new(params).skip_draws(15), 25);
    assert_eq!(resumed, whole[15..]);
}

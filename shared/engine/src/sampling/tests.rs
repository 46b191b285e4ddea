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
    assert!((s.logprob.unwrap() - expected).abs() < 1e-5);
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
        "max_tokens must be between 1 and 32768, got 0"
    );
    assert_eq!(
        bad(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }),
        "top_p must be in (0, 1], got 0"
    );
    assert!(SamplingParams {
        temperature: f32::NAN,
        ..Default::default()
    }
    .validate()
    .is_err());
    assert!(SamplingParams::default().validate().is_ok());
}

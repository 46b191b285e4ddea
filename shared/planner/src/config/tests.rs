use std::time::Duration;

use super::*;

fn with(change: impl FnOnce(&mut PlannerConfig)) -> PlannerConfig {
    let mut config = PlannerConfig::default();
    change(&mut config);
    config
}

type Change = fn(&mut PlannerConfig);

fn message(config: PlannerConfig) -> String {
    config.validate().unwrap_err().to_string()
}

#[test]
fn the_defaults_are_valid_and_what_the_flags_document() {
    let config = PlannerConfig::default();
    assert_eq!(config.validate(), Ok(()));
    assert_eq!(config.slo_ttft, Duration::from_secs(2));
    assert_eq!(config.slo_itl, Duration::from_millis(100));
    assert_eq!(config.interval, Duration::from_secs(10));
    assert_eq!(config.load_poll, Duration::from_secs(1));
    assert_eq!(config.min_change_interval, Duration::from_secs(60));
    assert_eq!(config.ack_timeout, Duration::from_secs(60));
    assert_eq!(config.hysteresis, 0.2);
    assert_eq!(config.patience, 2);
    assert_eq!(config.min_prefill, 0);
    assert_eq!(config.min_decode, 1);
    assert!((config.room() - 0.8).abs() < 1e-12);
}

#[test]
fn zero_durations_name_their_flag() {
    let cases: [(&str, Change); 5] = [
        ("--slo-ttft", |c| c.slo_ttft = Duration::ZERO),
        ("--slo-itl", |c| c.slo_itl = Duration::ZERO),
        ("--interval", |c| c.interval = Duration::ZERO),
        ("--load-poll", |c| c.load_poll = Duration::ZERO),
        ("--ack-timeout", |c| c.ack_timeout = Duration::ZERO),
    ];
    for (flag, change) in cases {
        let err = with(change).validate().unwrap_err();
        assert!(
            matches!(err, ConfigError::Zero { flag: f, .. } if f == flag),
            "{flag}: {err:?}"
        );
        assert!(
            err.to_string()
                .starts_with(&format!("{flag} must be greater than zero: ")),
            "{err}"
        );
    }
}

#[test]
fn an_interval_shorter_than_the_load_poll_names_both_flags() {
    let config = with(|c| {
        c.interval = Duration::from_millis(500);
        c.load_poll = Duration::from_secs(1);
    });
    assert_eq!(
        config.validate(),
        Err(ConfigError::IntervalBelowLoadPoll {
            interval: Duration::from_millis(500),
            load_poll: Duration::from_secs(1),
        })
    );
    assert_eq!(
        message(config),
        "--interval (500ms) must be at least --load-poll (1s): each decision needs a fresh load reading"
    );
    // Equal is fine.
    let equal = with(|c| c.interval = c.load_poll);
    assert_eq!(equal.validate(), Ok(()));
}

#[test]
fn hysteresis_must_be_in_zero_to_one() {
    for bad in [1.0, 1.5, -0.1] {
        let config = with(|c| c.hysteresis = bad);
        assert_eq!(config.validate(), Err(ConfigError::Hysteresis(bad)));
        assert!(
            message(config).starts_with(&format!("--hysteresis must be in [0, 1), got {bad}: ")),
            "{bad}"
        );
    }
    assert!(message(with(|c| c.hysteresis = f64::NAN)).contains("--hysteresis"));
    assert_eq!(with(|c| c.hysteresis = 0.0).validate(), Ok(()));
    assert_eq!(with(|c| c.hysteresis = 0.99).validate(), Ok(()));
}

#[test]
fn patience_zero_and_min_decode_zero_are_refused() {
    assert_eq!(
        message(with(|c| c.patience = 0)),
        "--patience must be at least 1, got 0: a violation must be seen before acting on it"
    );
    assert_eq!(
        message(with(|c| c.min_decode = 0)),
        "--min-decode must be at least 1, got 0: that allows a split that leaves no decode worker"
    );
    // No prefill worker is a valid split: decode workers prefill their own prompts.
    assert_eq!(with(|c| c.min_prefill = 0).validate(), Ok(()));
    // No cooldown is allowed too.
    assert_eq!(
        with(|c| c.min_change_interval = Duration::ZERO).validate(),
        Ok(())
    );
}

//! The latency rules: what one window's ratios call for ([`assess`]) and the worker counts the
//! cluster should have ([`desired`]). Pure functions of the configuration and the numbers;
//! pacing (patience, cooldown, acknowledgements) is the [`Planner`](super::Planner)'s.

use std::time::Duration;

use crate::proposal::human;
use crate::{Desired, PlannerConfig, Role};

/// One latency over the window against its target, in seconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Measure {
    /// The 90th percentile.
    pub p90: f64,
    /// The target.
    pub slo: f64,
}

impl Measure {
    /// A p90 measured in the window against `slo`; `None` without observations.
    pub fn of(p90: Option<Duration>, slo: Duration) -> Option<Measure> {
        p90.map(|p90| Measure {
            p90: p90.as_secs_f64(),
            slo: slo.as_secs_f64(),
        })
    }

    pub fn ratio(self) -> f64 {
        self.p90 / self.slo
    }
}

/// What the window's latencies call for, before pacing and worker availability.
pub(crate) enum Assessment {
    /// No flip: within SLOs, both over, or a ratio unknown.
    Steady(String),
    /// `over` is over its SLO but the other role has no room to give a worker.
    NoRoom { over: Role, why: String },
    /// `to` should get a worker from the other role; both latencies are known.
    Flip {
        to: Role,
        why: String,
        ttft: Measure,
        itl: Measure,
    },
}

/// What the latencies call for: a flip toward the role over its SLO while the other has room
/// (ratio below `1 − hysteresis`); nothing when both or neither are over, or a ratio is
/// unknown. `why` is the sentence with the numbers.
pub(crate) fn assess(
    config: &PlannerConfig,
    ttft: Option<Measure>,
    itl: Option<Measure>,
) -> Assessment {
    let room = config.room();
    let (ttft, itl) = match (ttft, itl) {
        (Some(ttft), Some(itl)) => (ttft, itl),
        (None, None) => {
            return Assessment::Steady(
                "no samples: no TTFT or ITL observed in the window".to_string(),
            )
        }
        (None, Some(m)) | (Some(m), None) => {
            let (known, unknown) = if ttft.is_some() {
                ("TTFT", "ITL")
            } else {
                ("ITL", "TTFT")
            };
            return Assessment::Steady(format!(
                "no {unknown} samples in the window ({known} p90 {}, SLO {})",
                human(m.p90),
                human(m.slo)
            ));
        }
    };
    let (t, i) = (human(ttft.p90), human(itl.p90));
    let (t_slo, i_slo) = (human(ttft.slo), human(itl.slo));
    let (t_room, i_room) = (human(ttft.slo * room), human(itl.slo * room));
    match (ttft.ratio() > 1.0, itl.ratio() > 1.0) {
        (true, true) => Assessment::Steady(format!(
            "both over SLO (TTFT p90 {t} > {t_slo}, ITL p90 {i} > {i_slo}): no flip helps"
        )),
        (false, false) => Assessment::Steady(format!(
            "within SLOs: TTFT p90 {t} ≤ {t_slo}, ITL p90 {i} ≤ {i_slo}"
        )),
        (true, false) if itl.ratio() < room => Assessment::Flip {
            to: Role::Prefill,
            why: format!("TTFT p90 {t} > SLO {t_slo} while ITL p90 {i} < {i_room}"),
            ttft,
            itl,
        },
        (true, false) => Assessment::NoRoom {
            over: Role::Prefill,
            why: format!(
                "TTFT p90 {t} > SLO {t_slo} but ITL p90 {i} ≥ {i_room} leaves decode no room"
            ),
        },
        (false, true) if ttft.ratio() < room => Assessment::Flip {
            to: Role::Decode,
            why: format!("ITL p90 {i} > SLO {i_slo} while TTFT p90 {t} < {t_room}"),
            ttft,
            itl,
        },
        (false, true) => Assessment::NoRoom {
            over: Role::Decode,
            why: format!(
                "ITL p90 {i} > SLO {i_slo} but TTFT p90 {t} ≥ {t_room} leaves prefill no room"
            ),
        },
    }
}

/// The counts the cluster should have, from `base` (the counts after this decision, draining
/// workers at the role they go to): one more of the role with the larger ratio when both are
/// over their SLOs, or of `stuck` (over its SLO, and no flip can relieve it); one fewer, of the
/// role with the smaller ratio, when both ratios are below `(1 − hysteresis) / 2` and the
/// cluster is above its minimums; never below the minimums. Ties count prefill as the larger.
pub(crate) fn desired(
    config: &PlannerConfig,
    ttft: Option<Measure>,
    itl: Option<Measure>,
    base: Desired,
    stuck: Option<Role>,
) -> Desired {
    let mut desired = base;
    if let (Some(ttft), Some(itl)) = (ttft, itl) {
        let (p, d) = (ttft.ratio(), itl.ratio());
        let (larger, smaller) = if p >= d {
            (Role::Prefill, Role::Decode)
        } else {
            (Role::Decode, Role::Prefill)
        };
        let idle = config.room() / 2.0;
        if p > 1.0 && d > 1.0 {
            *desired.slot(larger) += 1;
        } else if let Some(role) = stuck {
            *desired.slot(role) += 1;
        } else if p < idle && d < idle && base.total() > config.min_prefill + config.min_decode {
            if let Some(role) = [smaller, larger]
                .into_iter()
                .find(|&r| desired.of(r) > config.min(r))
            {
                *desired.slot(role) -= 1;
            }
        }
    }
    desired.prefill = desired.prefill.max(config.min_prefill);
    desired.decode = desired.decode.max(config.min_decode);
    desired
}

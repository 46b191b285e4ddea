//! How a load point's latencies move over time: the point cut into windows of a fixed width (by
//! when each request was sent); each change of the cluster's prefill/decode split (read from the
//! router's worker counts sampled while the point ran), with when the planner decided it (from
//! its decision counter, where the cluster runs one); and, for a point of several phases, each
//! phase's own latencies and how long after its start the planner first decided a move.

use serde::{Deserialize, Serialize};

use super::summary::{Percentiles, RequestRecord, Sample, Slo};

/// The requests sent during one window of a load point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Its start, in seconds since the point started.
    pub start_s: f64,
    /// Requests sent in it.
    pub requests: usize,
    pub errors: usize,
    /// TTFT p90 of its completed requests, in milliseconds.
    pub ttft_p90_ms: Option<f64>,
    /// The p90 over every gap between tokens of its completed requests, in milliseconds.
    pub itl_p90_ms: Option<f64>,
    /// The fraction of its requests that met the SLO.
    pub goodput_fraction: Option<f64>,
}

/// One change of the cluster's prefill/decode split.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SplitChange {
    /// When the planner decided it (the last sample whose decision counter rose, at or before
    /// the change), seconds since the point started; `None` without a planner's metrics.
    pub decided_s: Option<f64>,
    /// When the router first saw the new split (the moved worker drained and registered anew).
    pub changed_s: f64,
    /// (prefill, decode) workers before and after.
    pub from: (usize, usize),
    pub to: (usize, usize),
}

/// One phase of a load point of several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    pub phase: usize,
    /// When its first request was sent, in seconds since the point started.
    pub start_s: f64,
    pub requests: usize,
    pub errors: usize,
    pub ttft_ms: Option<Percentiles>,
    pub itl_ms: Option<Percentiles>,
    pub goodput_fraction: Option<f64>,
    /// The cluster's (prefill, decode) workers when the phase began, as last sampled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_at_start: Option<(usize, usize)>,
    /// Seconds from the phase's start to the first move decided (or, without a planner's
    /// metrics, seen) before the next phase began; `None`: nothing moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reaction_s: Option<f64>,
}

/// Latencies and goodput of `records` (completed ones for latencies, all for goodput).
struct Judged {
    requests: usize,
    errors: usize,
    ttft: Option<Percentiles>,
    itl: Option<Percentiles>,
    goodput: Option<f64>,
}

fn judge<'a>(records: impl Iterator<Item = &'a RequestRecord>, slo: Option<Slo>) -> Judged {
    let records: Vec<&RequestRecord> = records.collect();
    let ok = records.iter().filter(|r| r.ok());
    let ttft: Vec<f64> = ok.clone().filter_map(|r| r.ttft_ms).collect();
    let itl: Vec<f64> = ok.flat_map(|r| r.itl_ms.iter().copied()).collect();
    let good = slo.map(|slo| records.iter().filter(|r| slo.met(r)).count());
    Judged {
        requests: records.len(),
        errors: records.iter().filter(|r| !r.ok()).count(),
        ttft: Percentiles::of(&ttft),
        itl: Percentiles::of(&itl),
        goodput: good
            .filter(|_| !records.is_empty())
            .map(|g| g as f64 / records.len() as f64),
    }
}

/// `records` in windows of `width_s` seconds by when they were sent; empty windows are left
/// out.
pub fn windows(records: &[RequestRecord], width_s: f64, slo: Option<Slo>) -> Vec<Window> {
    if !(width_s.is_finite() && width_s > 0.0) {
        return Vec::new();
    }
    let mut by_window: std::collections::BTreeMap<u64, Vec<&RequestRecord>> = Default::default();
    for r in records.iter().filter(|r| r.start_s.is_finite()) {
        let index = (r.start_s.max(0.0) / width_s).floor() as u64;
        by_window.entry(index).or_default().push(r);
    }
    by_window
        .into_iter()
        .map(|(index, records)| {
            let j = judge(records.into_iter(), slo);
            Window {
                start_s: index as f64 * width_s,
                requests: j.requests,
                errors: j.errors,
                ttft_p90_ms: j.ttft.map(|p| p.p90),
                itl_p90_ms: j.itl.map(|p| p.p90),
                goodput_fraction: j.goodput,
            }
        })
        .collect()
}

/// The (prefill, decode) split a sample saw, when it saw the router's worker counts.
fn split(sample: &Sample) -> Option<(usize, usize)> {
    Some((
        sample.prefill_workers? as usize,
        sample.decode_workers? as usize,
    ))
}

/// Every change of the split the samples show, in order; each takes the oldest decision not yet
/// taken by an earlier change (a move is decided, then drains, then shows; the next may be
/// decided in the sample where the last one shows).
pub fn changes(samples: &[Sample]) -> Vec<SplitChange> {
    let mut out = Vec::new();
    let mut decided = std::collections::VecDeque::new();
    let (mut last, mut decisions) = (None, None::<f64>);
    for sample in samples {
        if let Some(count) = sample.planner_changes {
            let new = decisions.map_or(0.0, |d| count - d).max(0.0) as usize;
            decided.extend(std::iter::repeat_n(sample.t_s, new));
            decisions = Some(count);
        }
        let Some(now) = split(sample) else { continue };
        match last {
            Some(before) if before != now => {
                out.push(SplitChange {
                    decided_s: decided.pop_front(),
                    changed_s: sample.t_s,
                    from: before,
                    to: now,
                });
            }
            _ => {}
        }
        last = Some(now);
    }
    out
}

/// Each phase's statistics, for records that carry phases (none otherwise).
pub fn phases(records: &[RequestRecord], samples: &[Sample], slo: Option<Slo>) -> Vec<PhaseStats> {
    let count = match records.iter().filter_map(|r| r.phase).max() {
        Some(last) => last + 1,
        None => return Vec::new(),
    };
    let starts: Vec<f64> = (0..count)
        .map(|phase| {
            let of = records.iter().filter(|r| r.phase == Some(phase));
            of.map(|r| r.start_s).fold(f64::INFINITY, f64::min)
        })
        .collect();
    let moves = changes(samples);
    (0..count)
        .filter(|phase| starts[*phase].is_finite())
        .map(|phase| {
            let start_s = starts[phase];
            let end_s = starts[phase + 1..]
                .iter()
                .copied()
                .find(|s| s.is_finite())
                .unwrap_or(f64::INFINITY);
            let at_start = samples
                .iter()
                .rev()
                .filter(|s| s.t_s <= start_s)
                .find_map(split)
                .or_else(|| samples.iter().find_map(split));
            let reaction = moves
                .iter()
                .map(|m| m.decided_s.unwrap_or(m.changed_s))
                .find(|t| *t >= start_s && *t < end_s);
            let j = judge(records.iter().filter(|r| r.phase == Some(phase)), slo);
            PhaseStats {
                phase,
                start_s,
                requests: j.requests,
                errors: j.errors,
                ttft_ms: j.ttft,
                itl_ms: j.itl,
                goodput_fraction: j.goodput,
                split_at_start: at_start,
                reaction_s: reaction.map(|t| t - start_s),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(phase: usize, start_s: f64, ttft: f64, gap: f64) -> RequestRecord {
        RequestRecord {
            phase: Some(phase),
            start_s,
            ttft_ms: Some(ttft),
            itl_ms: vec![gap; 4],
            e2e_ms: ttft + 4.0 * gap,
            completion_tokens: 5,
            ..RequestRecord::default()
        }
    }

    fn sample(t_s: f64, prefill: f64, decode: f64, decided: f64) -> Sample {
        Sample {
            t_s,
            prefill_workers: Some(prefill),
            decode_workers: Some(decode),
            planner_changes: Some(decided),
            ..Sample::default()
        }
    }

    #[test]
    fn windows_group_requests_by_when_they_were_sent() {
        let mut failed = record(0, 12.0, 1.0, 1.0);
        failed.error = Some("UNAVAILABLE".into());
        let records = [
            record(0, 0.5, 100.0, 10.0),
            record(0, 9.9, 300.0, 30.0),
            failed,
            record(0, 31.0, 50.0, 5.0),
        ];
        let slo = Slo::parse("ttft=200").unwrap();
        let w = windows(&records, 10.0, Some(slo));
        let starts: Vec<f64> = w.iter().map(|w| w.start_s).collect();
        assert_eq!(starts, [0.0, 10.0, 30.0]);
        assert_eq!((w[0].requests, w[0].errors), (2, 0));
        assert_eq!(w[0].goodput_fraction, Some(0.5));
        assert!((w[0].ttft_p90_ms.unwrap() - 280.0).abs() < 1e-9);
        assert_eq!((w[1].requests, w[1].errors, w[1].ttft_p90_ms), (1, 1, None));
        assert_eq!(w[1].goodput_fraction, Some(0.0));
        assert_eq!(w[2].itl_p90_ms, Some(5.0));
        assert!(windows(&records, 0.0, None).is_empty());
    }

    #[test]
    fn a_move_is_timed_from_its_decision_and_counted_in_its_phase() {
        let records = [
            record(0, 0.0, 900.0, 10.0),
            record(0, 1.0, 1100.0, 10.0),
            record(1, 20.0, 100.0, 50.0),
            record(1, 21.0, 100.0, 70.0),
        ];
        let samples = [
            sample(0.0, 1.0, 3.0, 0.0),
            sample(5.0, 1.0, 3.0, 1.0), // decided in phase 0 ...
            sample(19.0, 1.0, 3.0, 1.0),
            sample(22.5, 2.0, 2.0, 1.0), // ... in place in phase 1, after draining
            sample(25.0, 2.0, 2.0, 1.0),
        ];
        let moves = changes(&samples);
        assert_eq!(
            moves,
            [SplitChange {
                decided_s: Some(5.0),
                changed_s: 22.5,
                from: (1, 3),
                to: (2, 2),
            }]
        );
        // The next move decided in the very sample where the first shows: each keeps its own.
        let two = [
            sample(0.0, 1.0, 3.0, 0.0),
            sample(14.5, 1.0, 3.0, 1.0),
            sample(24.5, 2.0, 2.0, 2.0),
            sample(27.5, 3.0, 1.0, 2.0),
        ];
        let decided: Vec<_> = changes(&two).iter().map(|c| c.decided_s).collect();
        assert_eq!(decided, [Some(14.5), Some(24.5)]);
        let p = phases(&records, &samples, None);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].start_s, p[0].requests), (0.0, 2));
        assert_eq!(p[0].split_at_start, Some((1, 3)));
        assert_eq!(p[0].reaction_s, Some(5.0));
        assert_eq!(p[1].start_s, 20.0);
        assert_eq!(p[1].split_at_start, Some((1, 3)));
        assert_eq!(p[1].reaction_s, None, "the move was phase 0's");
        assert_eq!(p[1].itl_ms.unwrap().max, 70.0);
        // Without a planner's metrics a move is timed when it is seen.
        let seen: Vec<Sample> = samples
            .iter()
            .map(|s| Sample {
                planner_changes: None,
                ..*s
            })
            .collect();
        assert_eq!(changes(&seen)[0].decided_s, None);
        assert_eq!(phases(&records, &seen, None)[1].reaction_s, Some(2.5));
        // Records without phases have none.
        let plain = [RequestRecord::default()];
        assert!(phases(&plain, &samples, None).is_empty());
    }
}

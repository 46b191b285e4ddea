//! The requests a load point sends, built from token ids so that their lengths are exact.
//!
//! Prompts are cut from a corpus (Pride and Prejudice unless `--corpus` names another text),
//! tokenized once, at seeded offsets: the same seed gives the same prompts, token for token,
//! whatever the cluster. Every request asks for exactly its output length (EOS ignored unless
//! asked otherwise).
//!
//! * fixed: every prompt `input` tokens, every answer `output` tokens;
//! * lognormal: prompt and answer lengths drawn from lognormal distributions with the given
//!   means and shape `sigma` (μ = ln(mean) − σ²/2, so the mean is as given), at least 1 token
//!   and at most four times the mean;
//! * shared-prefix: G groups, each a system prompt of S tokens; each request is one group's
//!   system prompt (a group drawn at random) followed by a unique question of `input` tokens;
//! * multi-turn: sessions of T turns; each turn sends the whole conversation so far (every
//!   earlier prompt and answer) plus a new user message of `input` tokens, after a think time.
//!
//! A plan may run several [`Phase`]s one after the other at each load point (a load that
//! shifts, say from long prompts to long answers): each phase's jobs are offered after the
//! previous phase's, on the same clients.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

/// The text prompts are cut from when no `--corpus` is given.
pub const DEFAULT_CORPUS: &str = include_str!(
    "../../../../shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt"
);

/// What the requests look like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Workload {
    /// Every prompt `input` tokens, every answer `output`.
    Fixed { input: usize, output: usize },
    /// Lognormal lengths with these means and shape.
    Lognormal {
        input: usize,
        output: usize,
        sigma: f64,
    },
    /// `groups` system prompts of `system` tokens, each request one of them and a question of
    /// `input` tokens.
    SharedPrefix {
        groups: usize,
        system: usize,
        input: usize,
        output: usize,
    },
    /// Sessions of `turns` turns, each adding a user message of `input` tokens and an answer of
    /// `output`, `think_ms` apart.
    MultiTurn {
        turns: usize,
        input: usize,
        output: usize,
        think_ms: u64,
    },
}

impl Workload {
    /// Checks the parameters, naming the one that is wrong.
    pub fn check(&self) -> Result<(), String> {
        let positive = |name: &str, v: usize| match v {
            0 => Err(format!("{name} must be at least 1")),
            _ => Ok(()),
        };
        match *self {
            Workload::Fixed { input, output } => {
                positive("input tokens", input)?;
                positive("output tokens", output)
            }
            Workload::Lognormal {
                input,
                output,
                sigma,
            } => {
                positive("input tokens", input)?;
                positive("output tokens", output)?;
                match sigma.is_finite() && (0.0..=3.0).contains(&sigma) {
                    true => Ok(()),
                    false => Err(format!("sigma {sigma} must be in 0..=3")),
                }
            }
            Workload::SharedPrefix {
                groups,
                system,
                input,
                output,
            } => {
                positive("groups", groups)?;
                positive("system tokens", system)?;
                positive("input tokens", input)?;
                positive("output tokens", output)
            }
            Workload::MultiTurn {
                turns,
                input,
                output,
                ..
            } => {
                positive("turns", turns)?;
                positive("input tokens", input)?;
                positive("output tokens", output)
            }
        }
    }

    /// The longest context one request of this workload can reach (prompt and answer), in
    /// tokens; lognormal lengths are capped at four times their means.
    pub fn max_context(&self) -> usize {
        match *self {
            Workload::Fixed { input, output } => input + output,
            Workload::Lognormal { input, output, .. } => 4 * (input + output),
            Workload::SharedPrefix {
                system,
                input,
                output,
                ..
            } => system + input + output,
            Workload::MultiTurn {
                turns,
                input,
                output,
                ..
            } => turns * (input + output),
        }
    }

    /// The fewest KV tokens requests in flight can keep resident: each one's own tokens, and
    /// those they may share (a shared-prefix group's system prompt, held once); lognormal
    /// lengths count at their means.
    pub fn resident_tokens(&self) -> (usize, usize) {
        match *self {
            Workload::Fixed { input, output } | Workload::Lognormal { input, output, .. } => {
                (input + output, 0)
            }
            Workload::SharedPrefix {
                system,
                input,
                output,
                ..
            } => (input + output, system),
            Workload::MultiTurn { .. } => (self.max_context(), 0),
        }
    }

    /// A short description for summaries: `fixed 512/64`.
    pub fn describe(&self) -> String {
        match *self {
            Workload::Fixed { input, output } => format!("fixed {input}/{output}"),
            Workload::Lognormal {
                input,
                output,
                sigma,
            } => format!("lognormal means {input}/{output}, sigma {sigma}"),
            Workload::SharedPrefix {
                groups,
                system,
                input,
                output,
            } => format!("shared-prefix {groups} x {system} + {input}/{output}"),
            Workload::MultiTurn {
                turns,
                input,
                output,
                think_ms,
            } => format!("multi-turn {turns} turns of {input}/{output}, {think_ms} ms think"),
        }
    }

    /// Whether a job's later turns build on its earlier answers.
    pub fn is_multi_turn(&self) -> bool {
        matches!(self, Workload::MultiTurn { .. })
    }

    /// The think time between turns.
    pub fn think_ms(&self) -> u64 {
        match *self {
            Workload::MultiTurn { think_ms, .. } => think_ms,
            _ => 0,
        }
    }
}

/// One part of a load point: `requests` jobs of one workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    pub workload: Workload,
    pub requests: usize,
}

impl Phase {
    /// Checks the workload and the count, naming what is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.requests == 0 {
            return Err("requests must be at least 1".into());
        }
        self.workload.check()
    }
}

/// One turn: the tokens it adds to its conversation and the answer length it asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub new_tokens: Vec<u32>,
    pub output: u32,
}

/// What one client sends: one request, or a multi-turn session's turns in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The shared-prefix group or the session number.
    pub group: Option<usize>,
    /// The phase of the load point it belongs to.
    pub phase: usize,
    /// How long the client waits before each turn after the first.
    pub think: std::time::Duration,
    pub turns: Vec<Turn>,
}

/// The corpus' tokens and the seeded choice of where prompts start.
pub struct Prompts {
    corpus: Vec<u32>,
    rng: StdRng,
}

impl Prompts {
    /// Over `corpus` (tokens; at least one), seeded.
    pub fn new(corpus: Vec<u32>, seed: u64) -> Result<Self, String> {
        if corpus.is_empty() {
            return Err("the corpus has no tokens".into());
        }
        Ok(Self {
            corpus,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// `n` consecutive corpus tokens from a random offset (wrapping around its end).
    pub fn take(&mut self, n: usize) -> Vec<u32> {
        let start = self.rng.gen_range(0..self.corpus.len());
        self.corpus
            .iter()
            .copied()
            .cycle()
            .skip(start)
            .take(n)
            .collect()
    }

    /// The jobs of one load point: each phase's in turn.
    pub fn phases(&mut self, phases: &[Phase]) -> Vec<Job> {
        let mut jobs = Vec::new();
        for (i, phase) in phases.iter().enumerate() {
            let mut these = self.jobs(&phase.workload, phase.requests);
            these.iter_mut().for_each(|job| job.phase = i);
            jobs.extend(these);
        }
        jobs
    }

    /// `count` jobs of `workload`.
    pub fn jobs(&mut self, workload: &Workload, count: usize) -> Vec<Job> {
        let think = std::time::Duration::from_millis(workload.think_ms());
        let mut jobs = self.jobs_of(workload, count);
        jobs.iter_mut().for_each(|job| job.think = think);
        jobs
    }

    fn jobs_of(&mut self, workload: &Workload, count: usize) -> Vec<Job> {
        match *workload {
            Workload::Fixed { input, output } => (0..count)
                .map(|_| Job {
                    group: None,
                    phase: 0,
                    think: Default::default(),
                    turns: vec![Turn {
                        new_tokens: self.take(input),
                        output: output as u32,
                    }],
                })
                .collect(),
            Workload::Lognormal {
                input,
                output,
                sigma,
            } => {
                let draw = |rng: &mut StdRng, mean: usize| {
                    let mu = (mean as f64).ln() - sigma * sigma / 2.0;
                    let d = LogNormal::new(mu, sigma).expect("sigma checked finite, >= 0");
                    (d.sample(rng).round() as usize).clamp(1, 4 * mean)
                };
                (0..count)
                    .map(|_| {
                        let input = draw(&mut self.rng, input);
                        let output = draw(&mut self.rng, output);
                        Job {
                            group: None,
                            phase: 0,
                            think: Default::default(),
                            turns: vec![Turn {
                                new_tokens: self.take(input),
                                output: output as u32,
                            }],
                        }
                    })
                    .collect()
            }
            Workload::SharedPrefix {
                groups,
                system,
                input,
                output,
            } => {
                let systems: Vec<Vec<u32>> = (0..groups).map(|_| self.take(system)).collect();
                (0..count)
                    .map(|_| {
                        // Groups in a seeded random order, as users of several applications
                        // arrive: never in step with a round robin over workers.
                        let group = self.rng.gen_range(0..groups);
                        let mut tokens = systems[group].clone();
                        tokens.extend(self.take(input));
                        Job {
                            group: Some(group),
                            phase: 0,
                            think: Default::default(),
                            turns: vec![Turn {
                                new_tokens: tokens,
                                output: output as u32,
                            }],
                        }
                    })
                    .collect()
            }
            Workload::MultiTurn {
                turns,
                input,
                output,
                ..
            } => (0..count)
                .map(|session| Job {
                    group: Some(session),
                    phase: 0,
                    think: Default::default(),
                    turns: (0..turns)
                        .map(|_| Turn {
                            new_tokens: self.take(input),
                            output: output as u32,
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Poisson arrival gaps of `rate` per second, seeded, in seconds.
pub fn arrival_gaps(rate: f64, count: usize, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| -(1.0 - rng.gen::<f64>()).ln() / rate)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts(seed: u64) -> Prompts {
        Prompts::new((0..1000).collect(), seed).unwrap()
    }

    #[test]
    fn jobs_are_seeded_and_token_exact() {
        let fixed = Workload::Fixed {
            input: 300,
            output: 7,
        };
        let a = prompts(1).jobs(&fixed, 5);
        assert_eq!(a, prompts(1).jobs(&fixed, 5));
        assert_ne!(a, prompts(2).jobs(&fixed, 5));
        for job in &a {
            assert_eq!(job.turns.len(), 1);
            assert_eq!(job.turns[0].new_tokens.len(), 300);
            assert_eq!(job.turns[0].output, 7);
        }
        // Prompts wrap around the corpus' end.
        assert_eq!(prompts(3).take(2500).len(), 2500);
    }

    #[test]
    fn shared_prefix_requests_share_their_groups_system_prompt() {
        let w = Workload::SharedPrefix {
            groups: 3,
            system: 64,
            input: 16,
            output: 4,
        };
        let jobs = prompts(7).jobs(&w, 30);
        let head = |j: &Job| j.turns[0].new_tokens[..64].to_vec();
        for a in &jobs {
            assert_eq!(a.turns[0].new_tokens.len(), 80);
            for b in &jobs {
                assert_eq!(a.group == b.group, head(a) == head(b));
            }
        }
        let groups: std::collections::HashSet<_> = jobs.iter().map(|j| j.group).collect();
        assert_eq!(groups.len(), 3);
        // Not in turn: a round robin over two workers would otherwise split groups evenly.
        let in_turn = jobs.iter().enumerate().all(|(i, j)| j.group == Some(i % 3));
        assert!(!in_turn);
    }

    #[test]
    fn lognormal_lengths_have_about_their_means() {
        let w = Workload::Lognormal {
            input: 200,
            output: 50,
            sigma: 0.5,
        };
        let jobs = prompts(11).jobs(&w, 4000);
        let mean = |f: &dyn Fn(&Job) -> usize| {
            jobs.iter().map(f).sum::<usize>() as f64 / jobs.len() as f64
        };
        let input = mean(&|j| j.turns[0].new_tokens.len());
        let output = mean(&|j| j.turns[0].output as usize);
        assert!((input / 200.0 - 1.0).abs() < 0.05, "{input}");
        assert!((output / 50.0 - 1.0).abs() < 0.05, "{output}");
    }

    #[test]
    fn bad_parameters_are_named() {
        let w = Workload::SharedPrefix {
            groups: 0,
            system: 1,
            input: 1,
            output: 1,
        };
        assert_eq!(w.check().unwrap_err(), "groups must be at least 1");
        let w = Workload::Lognormal {
            input: 1,
            output: 1,
            sigma: f64::NAN,
        };
        assert!(w.check().unwrap_err().contains("sigma"));
        assert!(Prompts::new(Vec::new(), 0).is_err());
    }

    #[test]
    fn phases_follow_each_other_with_their_own_lengths_and_think_times() {
        let phases = [
            Phase {
                workload: Workload::Fixed {
                    input: 100,
                    output: 2,
                },
                requests: 3,
            },
            Phase {
                workload: Workload::MultiTurn {
                    turns: 2,
                    input: 5,
                    output: 40,
                    think_ms: 7,
                },
                requests: 2,
            },
        ];
        let jobs = prompts(4).phases(&phases);
        let shape: Vec<_> = jobs
            .iter()
            .map(|j| (j.phase, j.turns.len(), j.turns[0].new_tokens.len(), j.think))
            .collect();
        let ms = std::time::Duration::from_millis;
        assert_eq!(
            shape,
            [
                (0, 1, 100, ms(0)),
                (0, 1, 100, ms(0)),
                (0, 1, 100, ms(0)),
                (1, 2, 5, ms(7)),
                (1, 2, 5, ms(7)),
            ]
        );
        assert_eq!(jobs, prompts(4).phases(&phases));
        let none = Phase {
            workload: phases[0].workload.clone(),
            requests: 0,
        };
        assert!(none.check().unwrap_err().contains("requests"));
    }

    #[test]
    fn poisson_gaps_average_one_over_the_rate() {
        let gaps = arrival_gaps(4.0, 20_000, 5);
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
        assert_eq!(gaps, arrival_gaps(4.0, 20_000, 5));
    }
}

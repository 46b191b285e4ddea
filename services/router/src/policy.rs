//! The placement policy: what a worker costs for a request, and how the cheapest is chosen
//! without herding.
//!
//! A worker's cost is in prompt tokens of work:
//!
//! ```text
//! cost = uncached_tokens                                  // prompt tokens the worker lacks
//!      + queued_prefill_tokens                            // prompt tokens queued ahead of it
//!      + request_cost_tokens × (running + waiting)        // requests sharing its steps
//!      + page_pressure_cost_tokens × used_fraction        // how full its page pool is
//! ```
//!
//! so a cached prefix attracts a request only while the worker holding it is not overloaded
//! by it: a request's first token waits for the prompt tokens queued ahead of it and its own,
//! so a worker holding a 2,048-token prefix loses to a cold one once 2,048 more prompt tokens
//! wait there; among decoding requests, with the defaults, it wins until it runs 16 more.
//!
//! Choosing is not a bare argmin. Costs within [`PolicyConfig::tie_tolerance_tokens`] of the best
//! are ties; among ties the worker with the fewest requests this router has in flight wins, and
//! among those a seeded pseudo-random choice (reservoir sampling over one pass), so equal scores
//! and cold starts spread over workers instead of piling on the first one. The seed makes runs
//! reproducible.

/// How a worker is chosen among those that can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Routing {
    /// The cheapest by [`PolicyConfig::cost`]: where the prompt's prefix is cached, unless that
    /// worker is loaded more than the prefix saves.
    #[default]
    #[value(name = "prefix")]
    PrefixAware,
    /// Each in turn, whatever it holds or runs (the baseline a plain load balancer gives). Pages
    /// a worker happens to cache are still reused; they only do not attract requests.
    RoundRobin,
}

impl Routing {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Routing::PrefixAware => "prefix",
            Routing::RoundRobin => "round-robin",
        }
    }
}

/// Tunables of the placement policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// How workers are chosen.
    pub routing: Routing,
    /// The decode worker prefills locally (no prefill worker, no transfer) when it lacks fewer
    /// than this many prompt tokens.
    pub local_prefill_threshold_tokens: usize,
    /// What one running or waiting request on a worker costs beyond the prompt tokens it still
    /// has to compute, in uncached prompt tokens: its share of every step.
    pub request_cost_tokens: f64,
    /// What a full page pool costs, in uncached prompt tokens (scaled by the fraction in use).
    pub page_pressure_cost_tokens: f64,
    /// Costs this close to the best are ties, broken by in-flight count then a seeded choice.
    pub tie_tolerance_tokens: f64,
    /// Seed of the tie-breaking choice.
    pub seed: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            routing: Routing::PrefixAware,
            local_prefill_threshold_tokens: 512,
            request_cost_tokens: 128.0,
            page_pressure_cost_tokens: 1024.0,
            tie_tolerance_tokens: 1.0,
            seed: 0x6e69_6262_6c65_7274,
        }
    }
}

impl PolicyConfig {
    /// Checks that every weight is finite and non-negative.
    pub(crate) fn validate(&self) -> crate::Result<()> {
        for (field, value) in [
            ("policy.request_cost_tokens", self.request_cost_tokens),
            (
                "policy.page_pressure_cost_tokens",
                self.page_pressure_cost_tokens,
            ),
            ("policy.tie_tolerance_tokens", self.tie_tolerance_tokens),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(crate::Error::InvalidConfig {
                    field,
                    reason: "must be finite and non-negative",
                });
            }
        }
        Ok(())
    }

    /// A worker's cost for a request (see the module docs).
    pub fn cost(&self, uncached_tokens: usize, load: &crate::Load) -> f64 {
        uncached_tokens as f64
            + load.queued_prefill_tokens as f64
            + self.request_cost_tokens * (f64::from(load.running) + f64::from(load.waiting))
            + self.page_pressure_cost_tokens * load.used_fraction()
    }
}

/// A small seeded generator (SplitMix64) for tie-breaking; not for anything secret.
#[derive(Debug, Clone)]
pub(crate) struct TieBreaker(u64);

impl TieBreaker {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u32) -> u32 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u32
    }
}

/// One worker offered to a [`Chooser`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Offer<T> {
    pub(crate) cost: f64,
    pub(crate) own_requests: u32,
    pub(crate) item: T,
}

/// One pass over candidates that keeps the cheapest, breaking ties as the module docs say.
pub(crate) struct Chooser<'a, T> {
    tolerance: f64,
    rng: &'a mut TieBreaker,
    best: Option<Offer<T>>,
    /// The lowest cost among the current ties; ties are measured from it.
    floor: f64,
    ties: u32,
}

impl<'a, T: Copy> Chooser<'a, T> {
    pub(crate) fn new(tolerance: f64, rng: &'a mut TieBreaker) -> Self {
        Self {
            tolerance,
            rng,
            best: None,
            floor: f64::INFINITY,
            ties: 0,
        }
    }

    pub(crate) fn offer(&mut self, offer: Offer<T>) {
        let Some(best) = self.best else {
            self.best = Some(offer);
            self.floor = offer.cost;
            self.ties = 1;
            return;
        };
        let tied = offer.cost <= self.floor + self.tolerance;
        let better = offer.cost < self.floor - self.tolerance
            || (tied && offer.own_requests < best.own_requests);
        if better {
            self.best = Some(offer);
            self.floor = offer.cost;
            self.ties = 1;
        } else if tied && offer.own_requests == best.own_requests {
            // Reservoir sampling: each of the `ties` equal offers is kept with probability
            // 1/ties.
            self.ties += 1;
            self.floor = self.floor.min(offer.cost);
            if self.rng.below(self.ties) == 0 {
                self.best = Some(offer);
            }
        }
    }

    /// The chosen offer, if any was made.
    pub(crate) fn chosen(self) -> Option<Offer<T>> {
        self.best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Load;

    fn choose(offers: &[(f64, u32)], rng: &mut TieBreaker) -> usize {
        let mut chooser = Chooser::new(1.0, rng);
        for (i, (cost, own)) in offers.iter().enumerate() {
            chooser.offer(Offer {
                cost: *cost,
                own_requests: *own,
                item: i,
            });
        }
        chooser.chosen().unwrap().item
    }

    #[test]
    fn cheapest_wins() {
        let mut rng = TieBreaker::new(1);
        assert_eq!(choose(&[(10.0, 0), (3.0, 5), (7.0, 0)], &mut rng), 1);
        assert_eq!(choose(&[(3.0, 0)], &mut rng), 0);
    }

    #[test]
    fn ties_go_to_the_least_in_flight() {
        let mut rng = TieBreaker::new(1);
        for _ in 0..20 {
            assert_eq!(choose(&[(5.0, 3), (5.5, 1), (5.0, 2)], &mut rng), 1);
        }
    }

    #[test]
    fn exact_ties_spread_uniformly() {
        let mut rng = TieBreaker::new(7);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[choose(&[(1.0, 0); 4], &mut rng)] += 1;
        }
        for count in counts {
            assert!((850..=1150).contains(&count), "{counts:?}");
        }
    }

    #[test]
    fn costs_weigh_cache_against_load() {
        let config = PolicyConfig::default();
        let idle = Load::default();
        let busy = Load {
            running: 4,
            waiting: 4,
            ..Load::default()
        };
        // A 2,048-token prefix is worth sixteen requests decoding...
        assert_eq!(config.cost(0, &busy), config.cost(1024, &idle));
        let busier = Load {
            running: 8,
            waiting: 8,
            ..Load::default()
        };
        assert_eq!(config.cost(0, &busier), config.cost(2048, &idle));
        // ...or 2,048 prompt tokens queued ahead.
        let queued = Load {
            queued_prefill_tokens: 2048,
            ..Load::default()
        };
        assert_eq!(config.cost(0, &queued), config.cost(2048, &idle));
        let full = Load {
            available_pages: 0,
            total_pages: 100,
            ..Load::default()
        };
        assert_eq!(config.cost(0, &full), 1024.0);
    }

    #[test]
    fn invalid_weights_are_refused() {
        let config = PolicyConfig {
            request_cost_tokens: f64::NAN,
            ..PolicyConfig::default()
        };
        assert!(config.validate().is_err());
        let config = PolicyConfig {
            tie_tolerance_tokens: -1.0,
            ..PolicyConfig::default()
        };
        assert!(config.validate().is_err());
        assert!(PolicyConfig::default().validate().is_ok());
    }
}

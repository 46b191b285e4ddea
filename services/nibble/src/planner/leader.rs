//! The planner's loop: campaign for the office, and while holding it read the signals, decide,
//! write decisions, follow their acknowledgements and publish the desired worker counts.
//!
//! Leadership is checked before every decision and every write is fenced by it
//! ([`Discovery::put_holding`]): a leader that lost its lease (or cannot reach etcd) writes
//! nothing from that moment, and campaigns again behind whoever took the office.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nibble_discovery::{Discovery, KvKey, Lifetime, WorkerInfo};
use nibble_planner::{
    Ack, Decision, Desired, History, Latency, Leader, Outcome, Planner, PlannerConfig,
};
use nibble_security::Peers;

use super::metrics;
use super::signals::{worker_loads, LatencySource};

/// One planner instance.
pub struct PlannerTask {
    pub id: String,
    pub config: PlannerConfig,
    pub discovery: Arc<dyn Discovery>,
    pub peers: Peers,
    pub latency: LatencySource,
}

fn key(name: &str) -> KvKey {
    KvKey::new(name).expect("the planner's keys are valid")
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The office and what the leader keeps between ticks.
struct Term {
    planner: Planner,
    history: History,
    /// The latency histograms at the start of the decision window.
    window_start: Latency,
    next_decision: Instant,
    desired: Option<Desired>,
}

impl PlannerTask {
    /// Runs until the task is dropped: campaigns every load poll while another leads, decides
    /// every interval while leading.
    pub async fn run(self) {
        let office = key(nibble_planner::wire::LEADER_KEY);
        let mut term: Option<Term> = None;
        let mut ticks = tokio::time::interval(self.config.load_poll);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let leading = match term {
                Some(_) => self.discovery.holds(&office).await,
                None => {
                    let leader = Leader {
                        id: self.id.clone(),
                        since_unix_ms: unix_ms(),
                    };
                    self.discovery.campaign(&office, leader.to_json()).await
                }
            };
            match (leading, term.is_some()) {
                (Ok(true), false) => {
                    tracing::info!(planner = %self.id, "planner: leading");
                    term = Some(self.begin().await);
                }
                (Ok(true), true) | (Ok(false), false) => {}
                (Ok(false), true) => {
                    tracing::warn!(planner = %self.id, "planner: another planner leads; deciding nothing");
                    term = None;
                }
                (Err(err), true) => {
                    tracing::warn!(planner = %self.id, %err, "planner: cannot confirm the office; deciding nothing");
                    term = None;
                }
                (Err(err), false) => {
                    tracing::debug!(%err, "planner: cannot campaign");
                }
            }
            metrics::leading(term.is_some());
            if let Some(term) = term.as_mut() {
                if !self.tick(term, &office).await {
                    tracing::warn!(planner = %self.id, "planner: lost the office while writing; deciding nothing");
                    metrics::leading(false);
                }
            }
        }
    }

    /// A new term: decision ids continue from the clock (so they grow across leaders), the
    /// history from what the last leader left.
    async fn begin(&self) -> Term {
        let history = match self
            .discovery
            .get(&key(nibble_planner::wire::HISTORY_KEY))
            .await
        {
            Ok(Some(bytes)) => History::parse(&bytes).unwrap_or_default(),
            _ => History::default(),
        };
        let last = history.latest().map_or(0, |e| e.decision.id);
        Term {
            planner: Planner::new(self.config.clone(), unix_ms().max(last + 1)),
            history,
            window_start: self.latency.read().await,
            next_decision: Instant::now() + self.config.interval,
            desired: None,
        }
    }

    /// One load poll as leader; false when a fenced write found the office gone.
    async fn tick(&self, term: &mut Term, office: &KvKey) -> bool {
        let workers = match self.discovery.list(None).await {
            Ok(workers) => workers,
            Err(err) => {
                // Cannot see the membership: decide nothing on a partial picture.
                tracing::warn!(%err, "planner: cannot list the workers");
                return true;
            }
        };
        let loads = worker_loads(&workers, &self.peers).await;
        self.follow_acks(term, &workers).await;
        if Instant::now() < term.next_decision {
            return true;
        }
        term.next_decision = Instant::now() + self.config.interval;
        let now = self.latency.read().await;
        let window = now.delta(&term.window_start);
        term.window_start = now;
        metrics::latency(&window);
        let outcome = term.planner.decide(Instant::now(), &loads, &window);
        if let Some(resolved) = term.planner.resolved().cloned() {
            term.history
                .resolve(resolved.decision, &resolved.resolution, unix_ms());
            if !self.write_history(term, office).await {
                return false;
            }
        }
        match outcome {
            Outcome::Hold { why } => {
                tracing::debug!(%why, "planner: holding");
                metrics::decision("hold");
            }
            Outcome::Change(proposal) => {
                let decision = Decision::from_proposal(&proposal, &self.id, unix_ms());
                tracing::info!(decision = decision.id, reason = %decision.reason.summary, "planner: decided");
                let written = self
                    .discovery
                    .put_holding(
                        office,
                        &key(nibble_planner::wire::DECISION_KEY),
                        decision.to_json(),
                        Lifetime::Session,
                    )
                    .await;
                match written {
                    Ok(true) => metrics::decision("change"),
                    Ok(false) => return false,
                    Err(err) => {
                        tracing::warn!(%err, "planner: could not write the decision");
                        return true;
                    }
                }
                term.history.push(decision);
                if !self.write_history(term, office).await {
                    return false;
                }
            }
        }
        if let Some(desired) = term.planner.desired() {
            metrics::desired(desired);
            if term.desired != Some(desired) {
                let written = self
                    .discovery
                    .put_holding(
                        office,
                        &key(nibble_planner::wire::DESIRED_KEY),
                        desired.to_json(),
                        Lifetime::Durable,
                    )
                    .await;
                match written {
                    Ok(true) => term.desired = Some(desired),
                    Ok(false) => return false,
                    Err(err) => {
                        tracing::warn!(%err, "planner: could not publish the desired counts")
                    }
                }
            }
        }
        true
    }

    /// Reads the acknowledgements of the workers the pending decision waits for; a worker no
    /// longer registered is gone (one that died mid-change leaves no decision stuck).
    async fn follow_acks(&self, term: &mut Term, workers: &[WorkerInfo]) {
        let Some(pending) = term.planner.pending() else {
            return;
        };
        let decision = pending.decision();
        let awaited: Vec<String> = pending.awaiting().map(str::to_owned).collect();
        for worker in awaited {
            if !workers.iter().any(|w| w.id.as_str() == worker) {
                term.planner.worker_gone(&worker);
                continue;
            }
            let key = key(&nibble_planner::wire::applied_key(&worker));
            let Ok(Some(bytes)) = self.discovery.get(&key).await else {
                continue;
            };
            match Ack::parse(&bytes) {
                Ok(ack) if ack.decision == decision => {
                    if !ack.applied {
                        tracing::warn!(%worker, detail = %ack.detail, "planner: a worker could not apply the decision");
                    }
                    term.planner.acknowledged(&worker, decision);
                }
                Ok(_) => {}
                Err(err) => tracing::warn!(%worker, %err, "planner: unreadable acknowledgement"),
            }
        }
    }

    async fn write_history(&self, term: &Term, office: &KvKey) -> bool {
        let written = self
            .discovery
            .put_holding(
                office,
                &key(nibble_planner::wire::HISTORY_KEY),
                term.history.to_json(),
                Lifetime::Durable,
            )
            .await;
        match written {
            Ok(written) => written,
            Err(err) => {
                tracing::warn!(%err, "planner: could not write the history");
                true
            }
        }
    }
}

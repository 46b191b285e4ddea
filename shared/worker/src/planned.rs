//! Following the planner: a worker reads the planner's decision (`planner/decision` in the
//! cluster's key-value store) every poll interval, and when a new decision gives it the other
//! role it changes role in place ([`Membership::change_role`]) and writes back which decision
//! it applied (`planner/applied/{worker}`, bound to its session).
//!
//! It fails static: while the store cannot be read, or holds no decision, or a decision cannot
//! be parsed, the worker keeps its role and says why in the log. A decision naming workers that
//! are not registered, or roles other than prefill and decode, is applied only for the entries
//! that make sense; the rest are ignored with a warning naming them.

use std::sync::Arc;
use std::time::Duration;

use nibble_discovery::{Discovery, KvKey, OutageLog, Role};
use nibble_planner::{Ack, Decision};

use crate::membership::Membership;

/// Reads the decision every `poll` and acts on new ones, until the task is aborted.
pub async fn follow(membership: Arc<Membership>, poll: Duration) {
    let decision_key = KvKey::new(nibble_planner::wire::DECISION_KEY).expect("a valid key");
    let mut seen = Seen::default();
    let mut unreadable = OutageLog::new("reading the planner's decision (keeping this role)");
    let mut ticks = tokio::time::interval(poll);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let discovery = membership.discovery();
        let read = discovery.get(&decision_key).await;
        // Fail static: keep the role; say so once, then twice a minute at most.
        match &read {
            Ok(_) => unreadable.recover(),
            Err(err) => unreadable.fail(err),
        }
        let Ok(Some(bytes)) = read else {
            continue;
        };
        if let Some(decision) = new_decision(discovery.as_ref(), &bytes, &mut seen).await {
            apply(&membership, &decision).await;
        }
    }
}

/// What this worker already read, so each decision is acted on and each bad value reported once.
#[derive(Default)]
struct Seen {
    decision: Option<u64>,
    malformed: Option<Vec<u8>>,
}

/// The decision in `bytes` if it is one this worker has not seen, its bad entries reported.
async fn new_decision(
    discovery: &dyn Discovery,
    bytes: &[u8],
    seen: &mut Seen,
) -> Option<Decision> {
    let workers = match discovery.list(None).await {
        Ok(workers) => workers,
        Err(err) => {
            tracing::warn!(%err, "cannot list the workers a decision names; trying again");
            return None;
        }
    };
    let known: Vec<&str> = workers
        .iter()
        .filter(|w| w.role != Role::Router)
        .map(|w| w.id.as_str())
        .collect();
    let (decision, warnings) = match Decision::parse(bytes, &known) {
        Ok(parsed) => parsed,
        Err(err) => {
            // A bad value stays bad until rewritten: reported once.
            if seen.malformed.as_deref() != Some(bytes) {
                tracing::warn!(%err, key = nibble_planner::wire::DECISION_KEY, "ignoring the planner decision");
                seen.malformed = Some(bytes.to_vec());
            }
            return None;
        }
    };
    if seen.decision.replace(decision.id) == Some(decision.id) {
        return None;
    }
    for warning in warnings {
        tracing::warn!(decision = decision.id, "{warning}");
    }
    Some(decision)
}

/// Changes role when `decision` says so, and acknowledges it.
async fn apply(membership: &Membership, decision: &Decision) {
    let id = membership.id().as_str();
    let Some(wanted) = decision.role_of(id) else {
        return;
    };
    let to = match wanted {
        nibble_planner::Role::Prefill => Role::Prefill,
        nibble_planner::Role::Decode => Role::Decode,
    };
    if membership.role().await == to {
        return;
    }
    tracing::info!(decision = decision.id, reason = %decision.reason.summary, "planner: becoming {to}");
    let (applied, detail) = match membership.change_role(to).await {
        Ok(change) => (
            true,
            format!(
                "{} → {} after draining for {} ms",
                change.from,
                change.to,
                change.drained_in.as_millis()
            ),
        ),
        Err(err) => {
            tracing::warn!(%err, decision = decision.id, "planner: the role change failed");
            (false, err.to_string())
        }
    };
    let ack = Ack {
        decision: decision.id,
        worker: id.to_string(),
        role: match membership.role().await {
            Role::Prefill => nibble_planner::Role::Prefill,
            _ => nibble_planner::Role::Decode,
        },
        applied,
        detail,
    };
    let key =
        KvKey::new(nibble_planner::wire::applied_key(id)).expect("worker ids are key segments");
    if let Err(err) = membership.discovery().put(&key, ack.to_json()).await {
        tracing::warn!(%err, "could not acknowledge the planner's decision");
    }
}

//! What the router decides for one request: a decode worker, maybe a prefill worker, and why.
//!
//! Invariant: a [`Decision`]'s prefill worker, when present, has the decode worker's KV-format
//! fingerprint, and its `reason` is [`Reason::Disaggregated`]; without one, the decode worker
//! prefills the prompt itself.

use std::fmt;
use std::sync::Arc;

use nibble_discovery::WorkerInfo;

use crate::slots::WorkerSlot;

/// Why a request is placed the way it is (a bounded metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The decode worker lacks fewer prompt tokens than the local-prefill threshold: it
    /// prefills them itself and nothing is transferred.
    LocalPrefill,
    /// A prefill worker computes the prompt and pushes the pages the decode worker lacks.
    Disaggregated,
    /// The prompt is long enough to disaggregate, but no prefill worker with the decode worker's
    /// KV format is available: the decode worker prefills it.
    NoPrefillWorkers,
    /// A scoring request (prompt log-probabilities): the decode worker computes the whole
    /// prompt, since the logits exist only where it is computed.
    Scoring,
}

impl Reason {
    /// Every reason, for pre-registering metric labels.
    pub const ALL: [Reason; 4] = [
        Reason::LocalPrefill,
        Reason::Disaggregated,
        Reason::NoPrefillWorkers,
        Reason::Scoring,
    ];

    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::LocalPrefill => "local_prefill",
            Reason::Disaggregated => "disaggregated",
            Reason::NoPrefillWorkers => "no_prefill_workers",
            Reason::Scoring => "scoring",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One worker chosen for a request.
#[derive(Debug, Clone)]
pub struct Placement {
    /// The worker's slot in the router (valid while it stays registered).
    pub slot: WorkerSlot,
    /// Its registration: id, addresses, KV-format fingerprint.
    pub worker: Arc<WorkerInfo>,
    /// Leading prompt tokens the router believes it caches (a multiple of the page size).
    pub cached_tokens: usize,
    /// The policy's cost for it (see [`PolicyConfig::cost`](crate::PolicyConfig::cost)).
    pub cost: f64,
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub struct Decision {
    /// The decode worker: reserves pages for what it lacks, then decodes.
    pub decode: Placement,
    /// The prefill worker that fills the decode worker's reservation; `None` when the decode
    /// worker prefills locally.
    pub prefill: Option<Placement>,
    /// Why.
    pub reason: Reason,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
}

impl Decision {
    /// Prompt tokens that must be computed: by the prefill worker when there is one, else by the
    /// decode worker.
    pub fn prefill_tokens(&self) -> usize {
        let cached = self
            .prefill
            .as_ref()
            .map_or(self.decode.cached_tokens, |p| p.cached_tokens);
        self.prompt_tokens - cached
    }

    /// Pages' worth of prompt tokens the prefill worker pushes to the decode worker (0 when
    /// prefilled locally).
    pub fn transferred_tokens(&self) -> usize {
        match self.prefill {
            Some(_) => self.prompt_tokens - self.decode.cached_tokens,
            None => 0,
        }
    }
}

/// Names one dispatched request in the router's in-flight accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub(crate) u64);

impl Ticket {
    /// The ticket's number (unique for the life of a router), for logs.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A decision that was dispatched: its load is counted on its workers until
/// [`Router::finish`](crate::Router::finish) is called with the ticket.
#[derive(Debug, Clone)]
pub struct Routed {
    pub ticket: Ticket,
    pub decision: Decision,
}

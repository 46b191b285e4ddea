//! [`Router`]: the plain state a router service's actor owns — the workers it knows, the prefix
//! index their KV events feed, their live load, and the requests it has in flight.
//!
//! Everything here is synchronous and single-owner: a service feeds it membership changes
//! (discovery), KV-event batches and snapshots (each worker's stream), load reports (polling),
//! asks it to [`route`](Router::route) requests, and reports when they end. Nothing blocks and
//! nothing allocates per decision beyond the returned [`Decision`].
//!
//! Invariants:
//! * a worker is tracked under exactly one slot, found by `(role, id)`, and every tracked worker
//!   serves the router's model with its page size (and its KV-format fingerprint, when the
//!   router was given one); incompatible registrations are refused, never placed;
//! * the index, the role sets and the worker table register the same slots;
//! * an in-flight request's load is counted on a worker only while the worker registration it
//!   was dispatched to lives (a slot reused by a new registration is never debited for it).

use std::collections::HashMap;
use std::sync::Arc;

use nibble_discovery::{Role, WorkerEvent, WorkerId, WorkerInfo};
use nibble_kvcache::{KvEvent, KvSnapshot};

use crate::decision::{Decision, Placement, Reason, Routed, Ticket};
use crate::index::{PrefixDepths, PrefixIndex, DEFAULT_MAX_BUFFERED_EVENTS};
use crate::load::{LiveLoad, Load, LoadReport};
use crate::policy::{Chooser, Offer, PolicyConfig, Routing, TieBreaker};
use crate::prompt::Prompt;
use crate::slots::{WorkerSet, WorkerSlot, MAX_WORKERS};
use crate::sync::SyncReport;
use crate::{Error, Result};

/// What a router routes and how.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// The model routed; workers serving another are refused.
    pub model: String,
    /// Tokens per page, the unit prompts are hashed in; workers with another are refused.
    pub page_size: u32,
    /// The KV-format fingerprint workers must have. `None` accepts any, but still pairs a
    /// prefill worker only with a decode worker of the same fingerprint.
    pub kv_fingerprint: Option<u64>,
    /// The placement policy.
    pub policy: PolicyConfig,
    /// KV events buffered per worker while it waits for a snapshot.
    pub max_buffered_events: usize,
}

impl RouterConfig {
    /// The defaults for `model` with pages of `page_size` tokens.
    pub fn new(model: impl Into<String>, page_size: u32) -> Self {
        Self {
            model: model.into(),
            page_size,
            kv_fingerprint: None,
            policy: PolicyConfig::default(),
            max_buffered_events: DEFAULT_MAX_BUFFERED_EVENTS,
        }
    }
}

/// One tracked worker.
#[derive(Debug)]
struct Worker {
    info: Arc<WorkerInfo>,
    load: LiveLoad,
    /// Distinguishes registrations that reuse a slot.
    generation: u64,
}

/// Load a request holds on one worker.
#[derive(Debug, Clone, Copy)]
struct Hold {
    slot: WorkerSlot,
    generation: u64,
    pages: u64,
    /// Prompt tokens it computes there and has not yet (0 once its first token came).
    prefill_tokens: u64,
}

/// A dispatched request.
#[derive(Debug)]
struct InFlight {
    decode: Hold,
    prefill: Option<Hold>,
    fingerprint: u64,
    /// Prefill workers that failed this request.
    failed: WorkerSet,
}

/// A worker as the router sees it now.
#[derive(Debug, Clone)]
pub struct WorkerStatus {
    pub slot: WorkerSlot,
    pub info: Arc<WorkerInfo>,
    pub load: Load,
    /// Blocks the index holds for it.
    pub blocks: usize,
    /// Whether its blocks wait on a snapshot.
    pub needs_snapshot: bool,
}

/// Counts for gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterStats {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// Distinct blocks in the prefix index.
    pub index_blocks: usize,
    /// Requests dispatched and not finished.
    pub in_flight: usize,
    /// Workers marked unreachable ([`Router::set_reachable`]).
    pub unreachable_workers: usize,
}

/// The router's state (see the module docs).
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    index: PrefixIndex,
    workers: Vec<Option<Worker>>,
    prefill_ids: HashMap<WorkerId, WorkerSlot>,
    decode_ids: HashMap<WorkerId, WorkerSlot>,
    prefill: WorkerSet,
    decode: WorkerSet,
    /// Workers a call could not reach (a refused connection, a failed load poll): left out of
    /// placement until they answer again, without waiting for their registration to expire.
    down: WorkerSet,
    in_flight: HashMap<u64, InFlight>,
    next_ticket: u64,
    next_generation: u64,
    tie_breaker: TieBreaker,
    /// Under [`Routing::RoundRobin`]: the slot index each role's next turn starts from (decode,
    /// prefill).
    turn: [usize; 2],
}

impl Router {
    /// An empty router.
    pub fn new(config: RouterConfig) -> Result<Self> {
        if config.page_size == 0 {
            return Err(Error::InvalidConfig {
                field: "page_size",
                reason: "must be positive",
            });
        }
        config.policy.validate()?;
        Ok(Self {
            index: PrefixIndex::new(config.max_buffered_events),
            workers: (0..MAX_WORKERS).map(|_| None).collect(),
            prefill_ids: HashMap::new(),
            decode_ids: HashMap::new(),
            prefill: WorkerSet::EMPTY,
            decode: WorkerSet::EMPTY,
            down: WorkerSet::EMPTY,
            in_flight: HashMap::new(),
            next_ticket: 1,
            next_generation: 1,
            tie_breaker: TieBreaker::new(config.policy.seed),
            turn: [0; 2],
            config,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The prefix index (read-only, for diagnostics).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    // ---- membership ----

    /// Applies a discovery event. Routers' own registrations are ignored.
    pub fn apply_worker_event(&mut self, event: WorkerEvent) -> Result<()> {
        match event {
            WorkerEvent::Added(info) | WorkerEvent::Updated(info) => {
                if info.role == Role::Router {
                    return Ok(());
                }
                self.upsert_worker(info).map(|_| ())
            }
            WorkerEvent::Removed { role, id } => {
                self.remove_worker(role, &id);
                Ok(())
            }
        }
    }

    /// Starts tracking a worker, or updates a tracked one's registration (addresses, capacity).
    /// An incompatible registration is refused; if it replaces a compatible one, that worker is
    /// removed.
    pub fn upsert_worker(&mut self, info: WorkerInfo) -> Result<WorkerSlot> {
        if let Err(err) = self.check_compatible(&info) {
            self.remove_worker(info.role, &info.id);
            return Err(err);
        }
        if let Ok(slot) = self.slot(info.role, &info.id) {
            let worker = self.workers[slot.index()]
                .as_mut()
                .expect("tracked ids have workers");
            worker.load.observe_capacity(info.capacity);
            worker.info = Arc::new(info);
            return Ok(slot);
        }
        let Some(slot) = self.index.register() else {
            return Err(Error::TooManyWorkers {
                role: info.role,
                id: info.id,
                max: MAX_WORKERS,
            });
        };
        // `check_compatible` refused routers: this is a prefill or a decode worker.
        if info.role == Role::Prefill {
            self.prefill_ids.insert(info.id.clone(), slot);
            self.prefill.insert(slot);
        } else {
            self.decode_ids.insert(info.id.clone(), slot);
            self.decode.insert(slot);
        }
        self.workers[slot.index()] = Some(Worker {
            load: LiveLoad::new(info.capacity),
            info: Arc::new(info),
            generation: self.next_generation,
        });
        self.next_generation += 1;
        Ok(slot)
    }

    /// Stops tracking a worker and drops its blocks. Returns how many blocks it held, or `None`
    /// if it was not tracked. Its in-flight requests stay until they finish, debiting nothing.
    pub fn remove_worker(&mut self, role: Role, id: &WorkerId) -> Option<usize> {
        let slot = self.ids_mut(role)?.remove(id)?;
        self.prefill.remove(slot);
        self.decode.remove(slot);
        self.down.remove(slot);
        self.workers[slot.index()] = None;
        self.index.remove_worker(slot)
    }

    fn check_compatible(&self, info: &WorkerInfo) -> Result<()> {
        if info.role == Role::Router {
            return Err(Error::NotAWorker {
                role: info.role,
                id: info.id.clone(),
            });
        }
        if info.model != self.config.model {
            return Err(Error::ModelMismatch {
                role: info.role,
                id: info.id.clone(),
                expected: self.config.model.clone(),
                got: info.model.clone(),
            });
        }
        if info.page_size != self.config.page_size {
            return Err(Error::PageSizeMismatch {
                role: info.role,
                id: info.id.clone(),
                expected: self.config.page_size,
                got: info.page_size,
            });
        }
        match self.config.kv_fingerprint {
            Some(expected) if expected != info.kv_fingerprint => Err(Error::FingerprintMismatch {
                role: info.role,
                id: info.id.clone(),
                expected,
                got: info.kv_fingerprint,
            }),
            _ => Ok(()),
        }
    }

    /// The ids of one role's workers (`None` for routers, which are never tracked).
    fn ids(&self, role: Role) -> Option<&HashMap<WorkerId, WorkerSlot>> {
        match role {
            Role::Prefill => Some(&self.prefill_ids),
            Role::Decode => Some(&self.decode_ids),
            Role::Router => None,
        }
    }

    fn ids_mut(&mut self, role: Role) -> Option<&mut HashMap<WorkerId, WorkerSlot>> {
        match role {
            Role::Prefill => Some(&mut self.prefill_ids),
            Role::Decode => Some(&mut self.decode_ids),
            Role::Router => None,
        }
    }

    /// The slot of a tracked worker.
    pub fn slot(&self, role: Role, id: &WorkerId) -> Result<WorkerSlot> {
        self.ids(role)
            .and_then(|ids| ids.get(id).copied())
            .ok_or_else(|| Error::UnknownWorker {
                role,
                id: id.clone(),
            })
    }

    /// A tracked worker's status.
    pub fn worker(&self, role: Role, id: &WorkerId) -> Option<WorkerStatus> {
        let slot = self.slot(role, id).ok()?;
        self.status(slot)
    }

    /// Every tracked worker, by slot.
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.index
            .workers()
            .iter()
            .filter_map(|slot| self.status(slot))
            .collect()
    }

    fn status(&self, slot: WorkerSlot) -> Option<WorkerStatus> {
        let worker = self.workers[slot.index()].as_ref()?;
        Some(WorkerStatus {
            slot,
            info: worker.info.clone(),
            load: worker.load.current(),
            blocks: self.index.block_count(slot),
            needs_snapshot: self.index.needs_snapshot(slot),
        })
    }

    /// Marks a worker unreachable (`down`) or reachable again; a down worker gets no new
    /// requests. Returns whether that changed anything.
    pub fn set_reachable(&mut self, role: Role, id: &WorkerId, reachable: bool) -> bool {
        let Ok(slot) = self.slot(role, id) else {
            return false;
        };
        let was = !self.down.contains(slot);
        if reachable {
            self.down.remove(slot);
        } else {
            self.down.insert(slot);
        }
        was != reachable
    }

    /// Decode workers that are registered and reachable: requests can be served while this is
    /// above zero.
    pub fn reachable_decode_workers(&self) -> usize {
        self.decode.difference(self.down).len()
    }

    /// The share of the KV pages in use on the reachable workers of `role`, in `[0, 1]`, as
    /// their last load reports (or registrations) say: pages neither free nor evictable over
    /// all pages, summed over the workers. 0 when none has reported a capacity.
    pub fn kv_cache_usage(&self, role: Role) -> f64 {
        match self.kv_pages(role) {
            (_, 0) => 0.0,
            (used, total) => used as f64 / total as f64,
        }
    }

    /// KV pages in use and in all over the reachable workers of `role`, from their load
    /// reports (a page only the prefix cache holds is not in use).
    pub fn kv_pages(&self, role: Role) -> (u64, u64) {
        let set = match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
            Role::Router => return (0, 0),
        };
        let (mut used, mut total) = (0u64, 0u64);
        for slot in set.difference(self.down) {
            if let Some(worker) = self.workers[slot.index()].as_ref() {
                let reported = worker.load.reported();
                used += reported.used_pages();
                total += reported.total_pages;
            }
        }
        (used, total)
    }

    /// Counts for gauges.
    pub fn stats(&self) -> RouterStats {
        RouterStats {
            prefill_workers: self.prefill.len(),
            decode_workers: self.decode.len(),
            index_blocks: self.index.len(),
            in_flight: self.in_flight.len(),
            unreachable_workers: self.down.len(),
        }
    }

    // ---- KV events and load ----

    /// Applies a batch of a worker's KV events from its cache life `instance_id`. When the
    /// report says [`SnapshotNeeded`](crate::SyncStatus::SnapshotNeeded), call the worker's
    /// `KvSnapshot` and pass the answer to [`apply_kv_snapshot`](Self::apply_kv_snapshot).
    pub fn apply_kv_events(
        &mut self,
        role: Role,
        id: &WorkerId,
        instance_id: u64,
        events: &[KvEvent],
    ) -> Result<SyncReport> {
        let slot = self.slot(role, id)?;
        Ok(self
            .index
            .apply_events(slot, instance_id, events)
            .expect("tracked workers are registered in the index"))
    }

    /// Replaces a worker's blocks with a snapshot of its cache life `instance_id` and replays the
    /// events buffered since the gap.
    pub fn apply_kv_snapshot(
        &mut self,
        role: Role,
        id: &WorkerId,
        instance_id: u64,
        snapshot: &KvSnapshot,
    ) -> Result<SyncReport> {
        let slot = self.slot(role, id)?;
        Ok(self
            .index
            .apply_snapshot(slot, instance_id, snapshot)
            .expect("tracked workers are registered in the index"))
    }

    /// Records a worker's load report.
    pub fn report_load(&mut self, role: Role, id: &WorkerId, report: LoadReport) -> Result<()> {
        let slot = self.slot(role, id)?;
        if let Some(worker) = self.workers[slot.index()].as_mut() {
            worker.load.report(report);
        }
        Ok(())
    }

    // ---- placement ----

    /// Decides where `prompt` goes, leaving out the workers in `exclude`, without counting it as
    /// dispatched (a dry run; [`route`](Self::route) is the real thing).
    pub fn decide(&mut self, prompt: &Prompt, exclude: WorkerSet) -> Result<Decision> {
        if prompt.page_size() != self.config.page_size {
            return Err(Error::PromptPageSize {
                expected: self.config.page_size,
                got: prompt.page_size(),
            });
        }
        let exclude = exclude.union(self.down);
        let decode = self.decode.difference(exclude);
        let prefill = self.prefill.difference(exclude);
        let depths = self
            .index
            .prefix_depths(prompt.hashes(), decode.union(prefill));
        let decode = self
            .choose(Role::Decode, decode, &depths, prompt, None)
            .ok_or(Error::NoDecodeWorkers)?;
        let uncached = prompt.tokens() - decode.cached_tokens;
        let local = match prompt.is_scored() {
            true => Some(Reason::Scoring),
            false => (uncached < self.config.policy.local_prefill_threshold_tokens)
                .then_some(Reason::LocalPrefill),
        };
        if let Some(reason) = local {
            return Ok(Decision {
                decode,
                prefill: None,
                reason,
                prompt_tokens: prompt.tokens(),
            });
        }
        let fingerprint = decode.worker.kv_fingerprint;
        let prefill = self.choose(Role::Prefill, prefill, &depths, prompt, Some(fingerprint));
        let reason = match prefill {
            Some(_) => Reason::Disaggregated,
            None => Reason::NoPrefillWorkers,
        };
        Ok(Decision {
            decode,
            prefill,
            reason,
            prompt_tokens: prompt.tokens(),
        })
    }

    /// Decides where `prompt` goes and counts it on its workers until [`finish`](Self::finish).
    pub fn route(&mut self, prompt: &Prompt, exclude: WorkerSet) -> Result<Routed> {
        let decision = self.decide(prompt, exclude)?;
        // The decode worker computes the prompt only when no prefill worker does.
        let decode = self.hold(&decision.decode, prompt, decision.prefill.is_none());
        let prefill = decision
            .prefill
            .as_ref()
            .map(|p| self.hold(p, prompt, true));
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        self.in_flight.insert(
            ticket.0,
            InFlight {
                decode,
                prefill,
                fingerprint: decision.decode.worker.kv_fingerprint,
                failed: WorkerSet::EMPTY,
            },
        );
        Ok(Routed { ticket, decision })
    }

    /// The request's prefill worker is done with it (its prefill returned): its load there ends.
    /// Returns false if the ticket is unknown or had no prefill worker.
    pub fn prefill_done(&mut self, ticket: Ticket) -> bool {
        let Some(hold) = self
            .in_flight
            .get_mut(&ticket.0)
            .and_then(|f| f.prefill.take())
        else {
            return false;
        };
        self.release(hold);
        true
    }

    /// The request's prefill worker failed it: picks another prefill worker with the decode
    /// worker's KV format, never one that already failed this request, and moves the request's
    /// load there. `None` when none is left (prefill on the decode worker, or fail the request).
    pub fn retry_prefill(&mut self, ticket: Ticket, prompt: &Prompt) -> Result<Option<Placement>> {
        let flight = self
            .in_flight
            .get_mut(&ticket.0)
            .ok_or(Error::UnknownTicket(ticket.0))?;
        let old = flight.prefill.take();
        if let Some(hold) = old {
            flight.failed.insert(hold.slot);
        }
        let (failed, fingerprint) = (flight.failed, flight.fingerprint);
        if let Some(hold) = old {
            self.release(hold);
        }
        let candidates = self.prefill.difference(failed.union(self.down));
        let depths = self.index.prefix_depths(prompt.hashes(), candidates);
        let Some(placement) = self.choose(
            Role::Prefill,
            candidates,
            &depths,
            prompt,
            Some(fingerprint),
        ) else {
            return Ok(None);
        };
        let hold = self.hold(&placement, prompt, true);
        if let Some(flight) = self.in_flight.get_mut(&ticket.0) {
            flight.prefill = Some(hold);
        }
        Ok(Some(placement))
    }

    /// The request's first token reached its client: the decode worker has computed its prompt.
    /// Returns false if the ticket is unknown.
    pub fn first_token(&mut self, ticket: Ticket) -> bool {
        let Some(flight) = self.in_flight.get_mut(&ticket.0) else {
            return false;
        };
        let hold = flight.decode;
        flight.decode.prefill_tokens = 0;
        if let Some(worker) = self.workers[hold.slot.index()].as_mut() {
            if worker.generation == hold.generation {
                worker.load.prefill_finished(hold.prefill_tokens);
            }
        }
        true
    }

    /// The request ended (finished, failed or cancelled): its load ends everywhere. Returns false
    /// if the ticket was unknown (already finished).
    pub fn finish(&mut self, ticket: Ticket) -> bool {
        let Some(flight) = self.in_flight.remove(&ticket.0) else {
            return false;
        };
        self.release(flight.decode);
        if let Some(hold) = flight.prefill {
            self.release(hold);
        }
        true
    }

    /// The worker of `set` for `prompt` (only those with `fingerprint`, when given): among those
    /// with room for the pages they lack, or among all if none has room; the cheapest, or under
    /// [`Routing::RoundRobin`] the next in turn for `role`.
    fn choose(
        &mut self,
        role: Role,
        set: WorkerSet,
        depths: &PrefixDepths,
        prompt: &Prompt,
        fingerprint: Option<u64>,
    ) -> Option<Placement> {
        let page_size = self.config.page_size as usize;
        let turn = usize::from(role == Role::Prefill);
        let round_robin = self.config.policy.routing == Routing::RoundRobin;
        for require_room in [true, false] {
            let mut chooser = Chooser::new(
                self.config.policy.tie_tolerance_tokens,
                &mut self.tie_breaker,
            );
            // Round robin: the first eligible slot at or after the turn, else the first one.
            let mut next: Option<(usize, Offer<(WorkerSlot, usize)>)> = None;
            for slot in set {
                let Some(worker) = self.workers[slot.index()].as_ref() else {
                    continue;
                };
                // A worker leaving its role takes nothing new of it.
                if worker.info.draining
                    || fingerprint.is_some_and(|f| f != worker.info.kv_fingerprint)
                {
                    continue;
                }
                let depth = depths.get(slot);
                let load = worker.load.current();
                if require_room && !load.fits((prompt.pages() - depth) as u64) {
                    continue;
                }
                let cached_tokens = depth * page_size;
                let offer = Offer {
                    cost: self
                        .config
                        .policy
                        .cost(prompt.tokens() - cached_tokens, &load),
                    own_requests: load.own_requests,
                    item: (slot, cached_tokens),
                };
                if round_robin {
                    // Slots iterate in index order: ahead of the turn beats wrapped around.
                    let rank = (slot.index() + MAX_WORKERS - self.turn[turn]) % MAX_WORKERS;
                    if next.as_ref().is_none_or(|(best, _)| rank < *best) {
                        next = Some((rank, offer));
                    }
                } else {
                    chooser.offer(offer);
                }
            }
            let chosen = match round_robin {
                true => next.map(|(_, offer)| offer),
                false => chooser.chosen(),
            };
            if let Some(offer) = chosen {
                let (slot, cached_tokens) = offer.item;
                if round_robin {
                    self.turn[turn] = (slot.index() + 1) % MAX_WORKERS;
                }
                let worker = self.workers[slot.index()].as_ref()?;
                return Some(Placement {
                    slot,
                    worker: worker.info.clone(),
                    cached_tokens,
                    cost: offer.cost,
                });
            }
        }
        None
    }

    /// Counts a request on a placement's worker, with its uncached prompt tokens pending there
    /// when `computes_prompt`.
    fn hold(&mut self, placement: &Placement, prompt: &Prompt, computes_prompt: bool) -> Hold {
        let pages =
            (prompt.pages() - placement.cached_tokens / self.config.page_size as usize) as u64;
        let prefill_tokens = match computes_prompt {
            true => prompt.tokens().saturating_sub(placement.cached_tokens) as u64,
            false => 0,
        };
        let worker = self.workers[placement.slot.index()]
            .as_mut()
            .expect("a placement names a tracked worker");
        worker.load.dispatch(pages, prefill_tokens);
        Hold {
            slot: placement.slot,
            generation: worker.generation,
            pages,
            prefill_tokens,
        }
    }

    /// Ends a hold, if the worker registration it was taken on still lives.
    fn release(&mut self, hold: Hold) {
        if let Some(worker) = self.workers[hold.slot.index()].as_mut() {
            if worker.generation == hold.generation {
                worker.load.finish(hold.pages, hold.prefill_tokens);
            }
        }
    }
}

#[cfg(test)]
mod tests;

//! [`Actor`]: the engine thread's side of the actor — it owns the [`Engine`], serves
//! [`Command`]s between steps and routes each step's events to their requests' senders.

use std::collections::HashMap;

use nibble_engine::scheduler::{FinishReason, SeqId};
use nibble_engine::{Backend, Engine, Event, RequestError, Usage};
use nibble_kvcache::PageId;
use nibble_nccl::link::{Stageable, Staging};
use tokio::sync::{mpsc, oneshot, watch};

use super::{Command, LoadSnapshot, StagingCheck, PUBLISH_LOAD_EVERY};
use crate::error::{Error, Result};
use crate::kv_events::KvPublisher;

/// How often a working engine counts the pages its prefix cache could give back.
const COUNT_EVICTABLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The engine thread's state.
pub(super) struct Actor<B: Backend> {
    engine: Engine<B>,
    senders: HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    publisher: KvPublisher,
    load: watch::Sender<LoadSnapshot>,
    /// When `load` was last published.
    load_at: Option<std::time::Instant>,
    /// The cache's reclaimable pages, as last counted, and when.
    evictable: (usize, Option<std::time::Instant>),
}

impl<B: Backend> Actor<B>
where
    B::Pages: 'static,
    B::Staging: Stageable,
{
    pub(super) fn new(
        engine: Engine<B>,
        publisher: KvPublisher,
        load: watch::Sender<LoadSnapshot>,
    ) -> Self {
        Self {
            engine,
            senders: HashMap::new(),
            publisher,
            load,
            load_at: None,
            evictable: (0, None),
        }
    }

    /// The engine's load. Counting the reclaimable pages walks the whole prefix cache (hundreds
    /// of thousands of blocks on a GPU), so a working engine counts them at most every
    /// [`COUNT_EVICTABLE_EVERY`]; an idle one every time.
    fn snapshot(&mut self) -> LoadSnapshot {
        let stale = self
            .evictable
            .1
            .is_none_or(|at| at.elapsed() >= COUNT_EVICTABLE_EVERY);
        if stale || !self.engine.has_work() {
            let s = self.engine.state();
            self.evictable = (
                s.cache.reclaimable(&s.pool),
                Some(std::time::Instant::now()),
            );
        }
        let s = self.engine.state();
        LoadSnapshot {
            free_pages: s.pool.free_pages(),
            total_pages: s.pool.total_pages(),
            cached_pages: s.cache.len(),
            evictable_pages: self.evictable.0,
            running: s.running(),
            waiting: s.waiting(),
            prefill_backlog: s.prefill_backlog(),
            held: s.held(),
            cache: s.cache.stats(),
        }
    }

    /// Publishes the load: always when idle (so an idle engine's published load is exact),
    /// else at most every [`PUBLISH_LOAD_EVERY`].
    pub(super) fn publish_load(&mut self) {
        let due = self
            .load_at
            .is_none_or(|at| at.elapsed() >= PUBLISH_LOAD_EVERY);
        if due || !self.engine.has_work() {
            let load = self.snapshot();
            self.load.send_replace(load);
            self.load_at = Some(std::time::Instant::now());
        }
    }

    /// Serves commands until every handle is gone and no work is left; returns early, with the
    /// reason, when a device failure leaves the engine unusable (its requests were failed, and
    /// dropping the actor ends every other request's stream).
    pub(super) fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) -> Option<String> {
        let mut open = true;
        loop {
            if !self.engine.has_work() {
                if !open {
                    break;
                }
                match commands.blocking_recv() {
                    Some(command) => self.handle(command),
                    None => break,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(command) => self.handle(command),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.reap_cancelled();
            if self.engine.has_work() {
                let events = self.engine.step();
                self.route(events);
                if let Some(failure) = self.engine.device_failure() {
                    return Some(failure.to_string());
                }
            }
            self.publisher.publish(self.engine.state());
            self.publish_load();
        }
        None
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit {
                id,
                prompt,
                resumed,
                params,
                prefill_only,
                events,
                reply,
            } => {
                let result = if prefill_only {
                    self.engine
                        .submit_prefill(id, prompt, params)
                        .map(|()| Vec::new())
                } else if resumed.is_empty() {
                    self.engine.submit(id, prompt, params).map(|()| Vec::new())
                } else {
                    self.engine.submit_resumed(id, prompt, &resumed, params)
                };
                self.started(id, result, events, reply);
            }
            Command::Reserve { id, prompt, reply } => {
                let _ = reply.send(self.engine.reserve(id, &prompt));
            }
            Command::Export { pages, reply } => {
                let _ = reply.send(self.export(&pages));
            }
            Command::Import {
                owner,
                pages,
                data,
                reply,
            } => {
                let result = self.holds(owner).and_then(|()| self.import(&pages, &data));
                let _ = reply.send(result);
            }
            Command::Gather { pages, into, reply } => {
                let _ = reply.send(self.gather(&pages, into));
            }
            Command::Scatter {
                owner,
                pages,
                staging,
                check,
                reply,
            } => {
                let result = match self.holds(owner) {
                    Ok(()) => self.scatter(&pages, staging, check),
                    Err(e) => (staging, Err(e)),
                };
                let _ = reply.send(result);
            }
            Command::StartDecode {
                id,
                first_token,
                resumed,
                params,
                events,
                reply,
            } => {
                let result = match resumed.is_empty() {
                    true => self.engine.start_decode(id, first_token, params),
                    false => self.engine.resume_decode(id, &resumed, params),
                };
                self.started(id, result, events, reply);
            }
            Command::Abort { id, reply } => {
                let found = self.engine.abort(id);
                if let Some(sender) = self.senders.remove(&id) {
                    // Tell whoever still listens that the request ended here.
                    let _ = sender.send(Event::Finished {
                        id,
                        reason: FinishReason::Aborted,
                        text: String::new(),
                        usage: Usage::default(),
                        error: None,
                    });
                }
                if let Some(reply) = reply {
                    let _ = reply.send(found);
                }
            }
            Command::Release { id, reply } => {
                let released = self.engine.release(id);
                if let Some(reply) = reply {
                    let _ = reply.send(released);
                }
            }
            Command::Load { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Command::KvSnapshot { reply } => {
                self.publisher.publish(self.engine.state());
                let _ = reply.send(self.publisher.snapshot());
            }
            #[cfg(feature = "testing")]
            Command::Fail => panic!("injected engine failure"),
        }
    }

    fn export(&self, pages: &[PageId]) -> Result<Vec<u8>> {
        let page_bytes = self.engine.state().pool.layout().page_bytes();
        let mut out = Vec::with_capacity(pages.len() * page_bytes);
        let mut page = Vec::new();
        for &id in pages {
            page.clear();
            self.engine.export_page(id, &mut page)?;
            out.extend_from_slice(&page);
        }
        Ok(out)
    }

    /// Whether reservation `owner` still holds its pages: they were not freed (and perhaps
    /// given to another request) by an Abort or the TTL since the write was asked for.
    fn holds(&self, owner: SeqId) -> Result<()> {
        match self.engine.state().tokens(owner) {
            Some(_) => Ok(()),
            None => Err(Error::UnknownReservation(owner.0)),
        }
    }

    fn import(&mut self, pages: &[PageId], data: &[u8]) -> Result<()> {
        let page_bytes = self.engine.state().pool.layout().page_bytes();
        if data.len() != pages.len() * page_bytes {
            return Err(Error::InvalidArgument(format!(
                "data must be {} pages of {page_bytes} bytes, got {} bytes",
                pages.len(),
                data.len()
            )));
        }
        for (&id, bytes) in pages.iter().zip(data.chunks_exact(page_bytes)) {
            self.engine.import_page(id, bytes)?;
        }
        Ok(())
    }

    /// Gathers `pages` into `into`; the buffer comes back either way.
    fn gather(&mut self, pages: &[PageId], into: Staging) -> (Staging, Result<()>) {
        match B::Staging::from_staging(into) {
            Ok(mut staged) => {
                let result = self.engine.stage_pages(pages, &mut staged);
                (staged.into_staging(), result.map_err(Into::into))
            }
            Err(other) => {
                let error = Error::Link(format!(
                    "a {} staging buffer does not fit this engine's pages",
                    kind(&other)
                ));
                (other, Err(error))
            }
        }
    }

    /// Checks and writes `staging` into `pages`; the buffer comes back either way.
    fn scatter(
        &mut self,
        pages: &[PageId],
        staging: Staging,
        check: StagingCheck,
    ) -> (Staging, Result<()>) {
        let page_bytes = self.engine.state().pool.layout().page_bytes();
        if staging.len() != pages.len() * page_bytes {
            let error = Error::InvalidArgument(format!(
                "staging must be {} pages of {page_bytes} bytes, got {} bytes",
                pages.len(),
                staging.len()
            ));
            return (staging, Err(error));
        }
        match B::Staging::from_staging(staging) {
            Ok(staged) => {
                let result = self
                    .engine
                    .staged_host_bytes(&staged)
                    .map_err(Error::from)
                    .and_then(|bytes| check(&bytes))
                    .and_then(|()| Ok(self.engine.unstage_pages(pages, &staged)?));
                (staged.into_staging(), result)
            }
            // Host bytes reach any engine page by page.
            Err(Staging::Host(bytes)) => {
                let result = check(&bytes).and_then(|()| self.import(pages, &bytes));
                (Staging::Host(bytes), result)
            }
            Err(device @ Staging::Device(_)) => (
                device,
                Err(Error::Link(
                    "device pages arrived at an engine running on the CPU".into(),
                )),
            ),
        }
    }

    /// Aborts every request whose receiver is gone.
    fn reap_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .senders
            .iter()
            .filter(|(_, s)| s.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.senders.remove(&id);
            self.engine.abort(id);
            tracing::debug!(request = id.0, "receiver dropped: request aborted");
        }
    }

    /// Sends each event to its request; a request that cannot be told is aborted (or, when
    /// prefilled, released).
    /// Answers a request's start: on success its events go to `events` from now on, beginning
    /// with those the start produced.
    fn started(
        &mut self,
        id: SeqId,
        result: std::result::Result<Vec<Event>, RequestError>,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<std::result::Result<(), RequestError>>,
    ) {
        match result {
            Ok(first) => {
                self.senders.insert(id, events);
                let _ = reply.send(Ok(()));
                self.route(first);
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    fn route(&mut self, events: Vec<Event>) {
        for event in events {
            let (id, last) = match &event {
                Event::Token { id, .. } | Event::PromptLogprobs { id, .. } => (*id, false),
                Event::Prefilled { id, .. } | Event::Finished { id, .. } => (*id, true),
            };
            let prefilled = matches!(event, Event::Prefilled { .. });
            let delivered = match self.senders.get(&id) {
                Some(sender) => sender.send(event).is_ok(),
                None => false,
            };
            if last {
                self.senders.remove(&id);
            }
            if !delivered {
                self.senders.remove(&id);
                if prefilled {
                    self.engine.release(id);
                } else {
                    self.engine.abort(id);
                }
            }
        }
    }
}

/// `host` or `device`, for errors.
fn kind(staging: &Staging) -> &'static str {
    match staging {
        Staging::Host(_) => "host",
        Staging::Device(_) => "device",
    }
}

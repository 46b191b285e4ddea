//! The engine actor: one OS thread owns the [`Engine`] and everything in it (model, page bytes,
//! scheduler, prefix cache); async code talks to it through a cloneable [`EngineHandle`].
//!
//! The thread loops: it takes every queued [`Command`], runs [`Engine::step`] while there is work,
//! and routes each step's events to the sender of the request they belong to. A request whose
//! receiver was dropped (the client went away) is aborted, so its pages return to the pool.
//! Prefix-cache changes are published on a broadcast channel as [`KvEventBatch`]es (see
//! [`KvPublisher`](crate::kv_events::KvPublisher)).
//!
//! The thread's side is [`engine_thread`]; this module is the handle and the commands.
//!
//! Invariant: every request the engine knows has exactly one live entry in `senders` until it
//! finishes, is prefilled (then its pages are *held* until [`EngineHandle::release`]), or is
//! aborted.
//!
//! A failing engine (a device error panics in the engine thread) ends the thread: every open
//! request's stream ends, every later call is [`Error::EngineStopped`], and
//! [`EngineHandle::stopped`] completes with the reason, so the worker can stop serving and leave
//! the membership at once rather than keep answering health checks for an engine that is gone.

use std::any::Any;
use std::sync::Arc;
use std::thread;

use bytes::Bytes;
use nibble_engine::calibrate::KSmoothing;
use nibble_engine::sampling::SamplingParams;
use nibble_engine::scheduler::{Reservation, SeqId};
use nibble_engine::{Backend, Engine, EngineConfig, Event, Model, RequestError, Tokenizer};
use nibble_kvcache::{CacheStats, PageId};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::error::{Error, Result};
use crate::format::KvFormatSpec;
use crate::kv_events::{KvCacheSnapshot, KvEventBatch, KvPublisher};
use nibble_nccl::link::{Stageable, Staging};

/// Events of one request, in order.
pub type EventStream = mpsc::UnboundedReceiver<Event>;

/// Checks received pages' bytes, back to back, before they are written
/// ([`EngineHandle::scatter_staging`]).
pub type StagingCheck = Box<dyn FnOnce(&[u8]) -> Result<()> + Send>;

/// What never changes about a running engine.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The page pool's format, as peers see it.
    pub kv_format: KvFormatSpec,
    /// `kv_format`'s fingerprint.
    pub fingerprint: u64,
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one page (data and scales of every layer's K and V).
    pub page_bytes: usize,
    /// Pages in the pool.
    pub total_pages: usize,
    /// The longest prompt plus completion, in tokens.
    pub max_context: usize,
    /// The model's end-of-sequence token ids.
    pub eos: Vec<u32>,
}

/// A moment's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadSnapshot {
    /// Pages no request and no cached block holds.
    pub free_pages: usize,
    /// Pages in the pool.
    pub total_pages: usize,
    /// Pages held by the prefix cache.
    pub cached_pages: usize,
    /// Of those, pages nothing else holds (no running or held request): reclaimable.
    pub evictable_pages: usize,
    /// Requests being prefilled or decoded.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Prompt tokens still to compute (running prompts' rest, waiting prompts less their cached
    /// prefix).
    pub prefill_backlog: usize,
    /// Requests holding pages outside the batch (prefilled, or reserved).
    pub held: usize,
    /// The prefix cache's lookup, hit and eviction counts since the engine started.
    pub cache: CacheStats,
}

/// A request to the engine thread.
enum Command {
    Submit {
        id: SeqId,
        prompt: Vec<u32>,
        /// A resumed request's output so far (empty for a new request).
        resumed: Vec<u32>,
        params: SamplingParams,
        prefill_only: bool,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<std::result::Result<(), RequestError>>,
    },
    Reserve {
        id: SeqId,
        prompt: Vec<u32>,
        reply: oneshot::Sender<std::result::Result<Reservation, RequestError>>,
    },
    Export {
        pages: Vec<PageId>,
        reply: oneshot::Sender<Result<Vec<u8>>>,
    },
    Import {
        owner: SeqId,
        pages: Vec<PageId>,
        data: Bytes,
        reply: oneshot::Sender<Result<()>>,
    },
    Gather {
        pages: Vec<PageId>,
        into: Staging,
        reply: oneshot::Sender<(Staging, Result<()>)>,
    },
    Scatter {
        owner: SeqId,
        pages: Vec<PageId>,
        staging: Staging,
        check: StagingCheck,
        reply: oneshot::Sender<(Staging, Result<()>)>,
    },
    StartDecode {
        id: SeqId,
        first_token: u32,
        /// A resumed request's output so far, which replaces `first_token` (empty otherwise).
        resumed: Vec<u32>,
        params: SamplingParams,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<std::result::Result<(), RequestError>>,
    },
    Abort {
        id: SeqId,
        reply: Option<oneshot::Sender<bool>>,
    },
    Release {
        id: SeqId,
        reply: Option<oneshot::Sender<bool>>,
    },
    Load {
        reply: oneshot::Sender<LoadSnapshot>,
    },
    KvSnapshot {
        reply: oneshot::Sender<KvCacheSnapshot>,
    },
    /// Fails the engine thread as a device error does (tests of the failure path).
    #[cfg(feature = "testing")]
    Fail,
}

/// A cloneable handle on the engine thread. The thread stops when every handle is dropped and
/// no request is left.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::UnboundedSender<Command>,
    kv_events: broadcast::Sender<KvEventBatch>,
    info: Arc<EngineInfo>,
    /// Why the engine thread ended, once it has.
    stopped: watch::Receiver<Option<String>>,
    /// The load the engine thread last published ([`EngineHandle::published_load`]).
    published: watch::Receiver<LoadSnapshot>,
}

/// How often a working engine publishes its load; an idle one publishes after every command.
/// A GPU's millisecond steps do not each pay for it (counting what the prefix cache could give
/// back walks the cache, and is done at most once a second while working).
const PUBLISH_LOAD_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Sets the engine's stop reason when the engine thread ends, however it ends.
struct StopGuard(watch::Sender<Option<String>>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.send_if_modified(|reason| {
            reason.get_or_insert_with(|| "the engine thread ended".into());
            true
        });
    }
}

/// The message of a caught panic.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "the engine panicked".into(),
    }
}

/// KV-event batches buffered per subscriber before it lags (and must resync from a snapshot).
const KV_EVENT_BUFFER: usize = 1024;

impl EngineHandle {
    /// Starts the engine thread for `model` and waits until the engine is built.
    pub fn spawn<B>(
        model: Model<B>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self>
    where
        B: Backend + 'static,
        B::Pages: 'static,
        B::Staging: Stageable,
        Model<B>: Send,
    {
        let layout = config.kv.layout(&model)?;
        let scales = config.kv.scales_for(layout.layers())?;
        let kv_format = KvFormatSpec {
            layout,
            scales,
            hadamard: config.kv.hadamard,
            window: config.kv.window,
            k_smoothing: config.kv.k_smoothing.as_ref().map(KSmoothing::digest),
            k_codes: config.kv.k_codes_digest(),
            prefill_work: config.kv.work(),
        };
        let (commands, rx) = mpsc::unbounded_channel();
        let (kv_events, _) = broadcast::channel(KV_EVENT_BUFFER);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let publisher = KvPublisher::new(kv_events.clone());
        let (stop_tx, stopped) = watch::channel(None);
        let (load_tx, published) = watch::channel(LoadSnapshot::default());
        thread::Builder::new()
            .name("nibble-engine".into())
            .spawn(move || {
                let guard = StopGuard(stop_tx);
                let engine = match Engine::new(model, tokenizer, config) {
                    Ok(engine) => engine,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let s = engine.state();
                let info = EngineInfo {
                    fingerprint: kv_format.fingerprint(),
                    kv_format,
                    page_size: s.pool.layout().page_size(),
                    page_bytes: s.pool.layout().page_bytes(),
                    total_pages: s.pool.total_pages(),
                    max_context: engine.model().config().max_context,
                    eos: engine.tokenizer().eos_token_id().into_iter().collect(),
                };
                let mut actor = Actor::new(engine, publisher, load_tx);
                // Its load is published before anyone can ask for it.
                actor.publish_load();
                let _ = ready_tx.send(Ok(info));
                let run = std::panic::AssertUnwindSafe(move || actor.run(rx));
                let failure = match std::panic::catch_unwind(run) {
                    Ok(failure) => failure,
                    Err(payload) => Some(panic_message(payload.as_ref())),
                };
                if let Some(reason) = failure {
                    tracing::error!(%reason, "the engine failed");
                    guard
                        .0
                        .send_replace(Some(format!("the engine failed: {reason}")));
                }
            })?;
        let info = ready_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(Self {
            commands,
            kv_events,
            info: Arc::new(info),
            stopped,
            published,
        })
    }

    /// Completes when the engine thread has ended, with the reason (a failure's message).
    pub async fn stopped(&self) -> String {
        let mut stopped = self.stopped.clone();
        let reason = match stopped.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the engine thread ended".into(),
        };
        reason
    }

    /// Why the engine thread ended, if it has.
    pub fn stop_reason(&self) -> Option<String> {
        self.stopped.borrow().clone()
    }

    /// Fails the engine thread as a device error does.
    #[cfg(feature = "testing")]
    pub fn inject_failure(&self) {
        let _ = self.send(Command::Fail);
    }

    /// The engine's fixed facts.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn send(&self, command: Command) -> Result<()> {
        self.commands
            .send(command)
            .map_err(|_| Error::EngineStopped)
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply))?;
        rx.await.map_err(|_| Error::EngineStopped)
    }

    async fn submit_request(
        &self,
        id: SeqId,
        prompt: Vec<u32>,
        resumed: Vec<u32>,
        params: SamplingParams,
        prefill_only: bool,
    ) -> Result<EventStream> {
        let (events, stream) = mpsc::unbounded_channel();
        self.call(|reply| Command::Submit {
            id,
            prompt,
            resumed,
            params,
            prefill_only,
            events,
            reply,
        })
        .await??;
        Ok(stream)
    }

    /// Queues a request; its events arrive on the returned stream, which ends after
    /// [`Event::Finished`]. Dropping the stream aborts the request.
    pub async fn submit(
        &self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<EventStream> {
        self.submit_request(id, prompt, Vec::new(), params, false)
            .await
    }

    /// Queues a request resumed after `output`, the tokens another worker generated and
    /// streamed ([`Engine::submit_resumed`]); events as for [`submit`](Self::submit), from the
    /// first token after them.
    pub async fn submit_resumed(
        &self,
        id: SeqId,
        prompt: Vec<u32>,
        output: Vec<u32>,
        params: SamplingParams,
    ) -> Result<EventStream> {
        self.submit_request(id, prompt, output, params, false).await
    }

    /// Queues a prefill-only request: the stream yields [`Event::Prefilled`] (or
    /// [`Event::Finished`] on failure). Its pages stay held until [`release`](Self::release).
    pub async fn submit_prefill(
        &self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<EventStream> {
        self.submit_request(id, prompt, Vec::new(), params, true)
            .await
    }

    /// Reserves pages for a prompt whose K/V another worker will push.
    pub async fn reserve(&self, id: SeqId, prompt: Vec<u32>) -> Result<Reservation> {
        Ok(self
            .call(|reply| Command::Reserve { id, prompt, reply })
            .await??)
    }

    /// The bytes of `pages`, concatenated (each exactly `page_bytes` long).
    pub async fn export_pages(&self, pages: Vec<PageId>) -> Result<Vec<u8>> {
        self.call(|reply| Command::Export { pages, reply }).await?
    }

    /// Writes `data` (`pages.len()` pages of `page_bytes` each) into pages reservation `owner`
    /// holds; refused if it no longer holds them (an Abort or its TTL came first).
    pub async fn import_pages(
        &self,
        owner: SeqId,
        pages: Vec<PageId>,
        data: impl Into<Bytes>,
    ) -> Result<()> {
        let data = data.into();
        self.call(|reply| Command::Import {
            owner,
            pages,
            data,
            reply,
        })
        .await?
    }

    /// `pages`, concatenated into the staging buffer `into` (a pooled buffer whose capacity
    /// holds them) for a device link: in device memory (on the engine's stream, after every
    /// kernel that wrote them) on a CUDA engine, the exported bytes on a CPU engine. The buffer
    /// comes back whatever happened (for its pool), unless the engine stopped.
    pub async fn gather_staging(
        &self,
        pages: Vec<PageId>,
        into: Staging,
    ) -> (Option<Staging>, Result<()>) {
        let called = self
            .call(|reply| Command::Gather { pages, into, reply })
            .await;
        match called {
            Ok((staging, result)) => (Some(staging), result),
            Err(e) => (None, Err(e)),
        }
    }

    /// Writes a staging buffer (`pages.len()` pages) into reserved pages, the inverse of
    /// [`gather_staging`](Self::gather_staging), once `check` passed on its bytes (a device
    /// buffer is copied to the host for it); nothing is written if it fails. The buffer comes
    /// back as from `gather_staging`.
    pub async fn scatter_staging(
        &self,
        owner: SeqId,
        pages: Vec<PageId>,
        staging: Staging,
        check: StagingCheck,
    ) -> (Option<Staging>, Result<()>) {
        let called = self
            .call(|reply| Command::Scatter {
                owner,
                pages,
                staging,
                check,
                reply,
            })
            .await;
        match called {
            Ok((staging, result)) => (Some(staging), result),
            Err(e) => (None, Err(e)),
        }
    }

    /// Starts decoding a filled reservation from the first token; events as for
    /// [`submit`](Self::submit), starting with that token.
    pub async fn start_decode(
        &self,
        id: SeqId,
        first_token: u32,
        params: SamplingParams,
    ) -> Result<EventStream> {
        self.start(id, first_token, Vec::new(), params).await
    }

    /// Starts decoding a filled reservation of a request resumed after `output`
    /// ([`Engine::resume_decode`]); events from the first token after it.
    pub async fn resume_decode(
        &self,
        id: SeqId,
        output: Vec<u32>,
        params: SamplingParams,
    ) -> Result<EventStream> {
        self.start(id, 0, output, params).await
    }

    async fn start(
        &self,
        id: SeqId,
        first_token: u32,
        resumed: Vec<u32>,
        params: SamplingParams,
    ) -> Result<EventStream> {
        let (events, stream) = mpsc::unbounded_channel();
        self.call(|reply| Command::StartDecode {
            id,
            first_token,
            resumed,
            params,
            events,
            reply,
        })
        .await??;
        Ok(stream)
    }

    /// Ends a request wherever it is, freeing its pages. False if it was unknown.
    pub async fn abort(&self, id: SeqId) -> Result<bool> {
        self.call(|reply| Command::Abort {
            id,
            reply: Some(reply),
        })
        .await
    }

    /// Frees what a prefilled request or a reservation holds. False if nothing was held.
    pub async fn release(&self, id: SeqId) -> Result<bool> {
        self.call(|reply| Command::Release {
            id,
            reply: Some(reply),
        })
        .await
    }

    /// Aborts without waiting (for drop guards); a stopped engine has nothing to free.
    pub fn abort_now(&self, id: SeqId) {
        let _ = self.send(Command::Abort { id, reply: None });
    }

    /// Releases held pages without waiting (for drop guards).
    pub fn release_now(&self, id: SeqId) {
        let _ = self.send(Command::Release { id, reply: None });
    }

    /// The engine's load now: waits for the step in progress (on a CPU, a prompt block can take
    /// seconds). For what must be exact, such as a drain or the pages an abort freed.
    pub async fn load(&self) -> Result<LoadSnapshot> {
        self.call(|reply| Command::Load { reply }).await
    }

    /// The engine's load as it last published it, without waiting: exact while the engine is
    /// idle, at most one step or [`PUBLISH_LOAD_EVERY`] old while it works. For what polls:
    /// the `Load` RPC (the router's placement, the planner), metrics, the registered capacity.
    pub fn published_load(&self) -> Result<LoadSnapshot> {
        match self.stopped.borrow().is_some() {
            true => Err(Error::EngineStopped),
            false => Ok(*self.published.borrow()),
        }
    }

    /// Every block of the prefix cache, with the id of the last published event it reflects.
    pub async fn kv_snapshot(&self) -> Result<KvCacheSnapshot> {
        self.call(|reply| Command::KvSnapshot { reply }).await
    }

    /// Prefix-cache events from now on. A lagging receiver misses batches: it sees a gap in
    /// ids and resyncs from [`kv_snapshot`](Self::kv_snapshot).
    pub fn subscribe_kv_events(&self) -> broadcast::Receiver<KvEventBatch> {
        self.kv_events.subscribe()
    }
}

mod engine_thread;
use engine_thread::Actor;

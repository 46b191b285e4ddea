//! The router's gRPC `Inference` service (inference.proto) over a shared [`Router`], by job:
//!
//! * this module: [`ServiceConfig`], what the router serves;
//! * [`state`]: [`Shared`], the state the service, the followers and the HTTP API share (the
//!   routing core, the admission queue, the worker clients);
//! * [`follow`]: membership from a discovery watch, and per worker its KV-event stream (into the
//!   prefix index; a gap triggers a snapshot) and its load;
//! * [`validate`]: the one validation of a request, for both public APIs;
//! * [`inference`]: [`InferenceService`], the gRPC service: validate (off the async threads),
//!   admit, route, dispatch;
//! * [`flow`]: one dispatched request: `Reserve` on D → `Prefill` on P (which pushes pages to
//!   D, retried on another P) → `Decode` on D, D's tokens streamed back, workers freed on any
//!   early end; moved to another D when its D cannot be reached before its first token, and
//!   resumed on another after the tokens it streamed when its D fails mid-stream.
//!
//! gRPC codes come from one place: the router core's errors through
//! [`From<Error> for Status`](crate::Error), refusals from [`validate`].

use std::sync::Arc;
use std::time::Duration;

use nibble_engine::Tokenizer;
use nibble_security::{Secret, Security};

use crate::admission::AdmissionConfig;
use crate::RouterConfig;

pub mod flow;
pub mod follow;
pub mod inference;
pub mod state;
pub mod validate;

pub use follow::follow_membership;
pub use inference::InferenceService;
pub use state::Shared;
pub use validate::ValidRequest;

/// How often each worker's load is polled, by default.
pub const DEFAULT_LOAD_INTERVAL: Duration = Duration::from_millis(250);

/// How many times a request whose decode worker fails mid-stream is resumed on another, by
/// default (see [`ServiceConfig::max_resumes`]).
pub const DEFAULT_MAX_RESUMES: u32 = 2;

/// Prompt bytes allowed per token of context by default (see
/// [`ServiceConfig::prompt_bytes_limit`]).
pub const PROMPT_BYTES_PER_TOKEN: usize = 64;

/// What the router serves.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The routing core's configuration (its `model` is the name workers register under).
    pub router: RouterConfig,
    /// The name clients use for the model (`/v1/models`, a request's `model`), when it is not
    /// the workers' [`RouterConfig::model`]: [`ServiceConfig::served_model`].
    pub served_model_name: Option<String>,
    /// The model's tokenizer (and chat template).
    pub tokenizer: Arc<Tokenizer>,
    /// Longest prompt plus completion, in tokens (0: unknown, not checked).
    pub max_context: u32,
    /// How many requests run at once and wait (see [`Admission`]).
    pub admission: AdmissionConfig,
    /// How often each worker's `Load` is polled.
    pub load_interval: Duration,
    /// Largest `stopping.max_tokens` a request may ask for (INVALID_ARGUMENT above).
    pub max_tokens_limit: u32,
    /// Most bytes of prompt text (or chat messages) a request may send; refused before it is
    /// tokenized. `None`: [`ServiceConfig::prompt_bytes_limit`]'s default.
    pub max_prompt_bytes: Option<usize>,
    /// gRPC connections open at once; more are closed as they arrive.
    pub grpc_max_connections: usize,
    /// How many times one request whose decode stream breaks after it sent tokens (its worker
    /// died or stopped) is resumed on another decode worker; 0 ends such a stream with an error.
    pub max_resumes: u32,
    /// The bearer key every `Inference` call must carry (`None`: open). The HTTP API checks
    /// its own [`HttpConfig::api_key`](crate::HttpConfig), set from the same flag.
    pub api_key: Option<Secret>,
    /// TLS of the public APIs and of the worker clients, and the internal token they send.
    pub security: Security,
}

impl ServiceConfig {
    /// The defaults for routing with `router` and `tokenizer`, prompts up to `max_context`.
    pub fn new(router: RouterConfig, tokenizer: Arc<Tokenizer>, max_context: u32) -> Self {
        // Structured outputs compile against the vocabulary's token trie: built before the
        // first constrained request needs it.
        tokenizer.warm_grammars();
        Self {
            router,
            served_model_name: None,
            tokenizer,
            max_context,
            admission: AdmissionConfig::default(),
            load_interval: DEFAULT_LOAD_INTERVAL,
            max_tokens_limit: nibble_engine::sampling::MAX_TOKENS_LIMIT,
            max_prompt_bytes: None,
            grpc_max_connections: nibble_proto::serving::DEFAULT_MAX_CONNECTIONS,
            max_resumes: DEFAULT_MAX_RESUMES,
            api_key: None,
            security: Security::default(),
        }
    }
}

impl ServiceConfig {
    /// The model's name as clients see it: `served_model_name`, else the workers' name. The
    /// router maps it to the workers' name; workers never see it.
    pub fn served_model(&self) -> &str {
        self.served_model_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or(&self.router.model)
    }

    /// The prompt byte limit: `max_prompt_bytes`, else [`PROMPT_BYTES_PER_TOKEN`] per token of
    /// the context (4 MiB when the context is unknown). No tokenizer's tokens are that long on
    /// average, so the default refuses only prompts that cannot fit.
    pub fn prompt_bytes_limit(&self) -> usize {
        self.max_prompt_bytes.unwrap_or(match self.max_context {
            0 => 4 << 20,
            context => context as usize * PROMPT_BYTES_PER_TOKEN,
        })
    }
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("router", &self.router)
            .field("served_model_name", &self.served_model_name)
            .field("max_context", &self.max_context)
            .field("admission", &self.admission)
            .field("load_interval", &self.load_interval)
            .field("max_tokens_limit", &self.max_tokens_limit)
            .field("max_prompt_bytes", &self.max_prompt_bytes)
            .field("grpc_max_connections", &self.grpc_max_connections)
            .field("max_resumes", &self.max_resumes)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("security", &self.security)
            .finish_non_exhaustive()
    }
}

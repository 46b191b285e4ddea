//! nibble's inference engine: model loading, tokenizer, the [`Backend`] compute seam with a CPU
//! reference backend, and the Llama-family forward pass.
//!
//! * [`gguf`]: GGUF v2/v3 reader and GGML dequantizers.
//! * [`config`]: [`ModelConfig`] from model metadata; [`Architecture`], [`RopeStyle`].
//! * [`weights`]: f32 weights uploaded to a backend once and shared.
//! * [`tokenizer`], [`chat`]: BPE tokenizer rebuilt from GGUF metadata; chat templates.
//! * [`backend`]: the [`Backend`] trait and [`CpuBackend`].
//! * [`kv`]: the [`KvStore`] seam through which every layer's attention runs, and the
//!   contiguous f32 [`ContiguousKv`] store.
//! * [`model`]: [`Model::forward`] over a batch of sequences.
//! * [`eval`]: NLL / perplexity helpers.

pub mod backend;
pub mod chat;
pub mod config;
pub mod detok;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod hadamard;
pub mod kv;
pub mod model;
pub mod paged;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod stop;
pub mod tokenizer;
pub mod weights;

pub use backend::cpu::{CpuBackend, CpuTensor};
pub use backend::{AttentionArgs, AttnGeometry, Backend, PagedSeq, RopeArgs};
pub use chat::ChatMessage;
pub use config::{Architecture, ModelConfig, RopeStyle};
pub use error::{Error, Result};
pub use kv::{ContiguousKv, KvBatch, KvStore, NewTokens, PagedBatch, PerSequence, StepTokens};
pub use model::{Logits, Model, SeqInput, Workspace};
pub use session::{KvConfig, PagedSession};
pub use tokenizer::Tokenizer;
pub use weights::{LayerWeights, Weights};

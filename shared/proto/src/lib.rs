//! nibble's gRPC API: the generated `nibble.v1` messages, clients and servers, plus what every
//! service and client needs next to them.
//!
//! - [`v1`]: the code generated from `proto/nibble/v1/*.proto` (the public `Inference` API, the
//!   internal `Worker` API, the `KvTransfer` page stream and their shared types).
//! - [`codec`]: the servers' codec, prost's but with a request message that does not decode
//!   answered INVALID_ARGUMENT (tonic-prost says INTERNAL).
//! - [`FILE_DESCRIPTOR_SET`] and [`serving`]: server reflection and `grpc.health.v1`, which every
//!   nibble service serves.
//! - [`fingerprint`]: the stable 64-bit fingerprint of a [`v1::KvFormat`] that peers compare
//!   before pages move.
//! - [`convert`]: conversions between wire types and the `nibble-kvfmt` / `nibble-kvcache` types,
//!   validating at the edge so only valid values cross it.
//! - [`request`]: request fields as the engine's sampling parameters, and refusals that carry
//!   their field as data (`nibble-field` metadata).

pub mod codec;
pub mod convert;
mod error;
pub mod fingerprint;
pub mod request;
pub mod serving;

pub use error::ConvertError;

/// Generated code of the `nibble.v1` package.
pub mod v1 {
    // The generated code follows prost's conventions, not ours; its docs come from the .proto
    // comments.
    #![allow(clippy::doc_lazy_continuation, clippy::large_enum_variant)]
    // The messages and servers, then the clients (generated apart: `build.rs`).
    tonic::include_proto!("nibble.v1");
    include!(concat!(env!("OUT_DIR"), "/clients/nibble.v1.rs"));
}

/// The encoded `FileDescriptorSet` of every `nibble.v1` file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("nibble_v1_descriptor");

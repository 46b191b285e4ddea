//! The codec of nibble's gRPC servers: prost's, except that a request message that does not
//! decode is the caller's fault, INVALID_ARGUMENT, where tonic-prost answers INTERNAL (which
//! reads as a server bug, and which clients retry).
//!
//! Only the servers use it (`build.rs` generates them with [`ServerCodec`]); the clients keep
//! prost's codec, for which a response that does not decode is indeed INTERNAL.

use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// [`ProstCodec`] with request decoding failures as INVALID_ARGUMENT ([`RequestDecoder`]).
#[derive(Debug, Clone)]
pub struct ServerCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for ServerCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for ServerCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RequestDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder(self.0.decoder())
    }
}

/// Decodes request messages as prost does; a message that does not decode (prost's only error)
/// is INVALID_ARGUMENT, naming what prost found.
#[derive(Debug, Clone)]
pub struct RequestDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for RequestDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            Status::invalid_argument(format!(
                "the request message is not a valid {}: {}",
                std::any::type_name::<U>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("message"),
                status.message()
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

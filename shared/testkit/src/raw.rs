//! A gRPC client that sends bytes of its choosing as a call's messages, as a peer that does not
//! speak protobuf (or lies) would: for checking what a server answers a malformed message.

use bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Calls `path` (`/package.Service/Method`) on the plaintext gRPC server at `address` with
/// `messages` as its request messages, each in its own gRPC frame, and returns the
/// status the call ended with (`Ok` if the server answered without an error).
pub async fn call(address: &str, path: &'static str, messages: Vec<Vec<u8>>) -> Status {
    let channel = Channel::from_shared(format!("http://{address}"))
        .expect("a host:port")
        .connect()
        .await
        .expect("the server accepts connections");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("the channel is ready");
    let request = tonic::Request::new(tokio_stream::iter(messages));
    let path = PathAndQuery::from_static(path);
    match grpc.streaming(request, path, RawCodec).await {
        Err(status) => status,
        Ok(response) => {
            let mut stream = response.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(())) => {}
                    Ok(None) => return Status::new(Code::Ok, ""),
                    Err(status) => return status,
                }
            }
        }
    }
}

/// Sends its messages' bytes as they are; reads and drops every response message.
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = ();
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<()>, Status> {
        buf.advance(buf.remaining());
        Ok(Some(()))
    }
}

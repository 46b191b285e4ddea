//! A request message that does not decode is the caller's fault: every call of a worker's
//! Worker and KvTransfer services answers it INVALID_ARGUMENT (tonic-prost's codec would say
//! INTERNAL), whatever the call's kind (unary, server or client streaming).

mod support;

use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{raw, WorkerApi};
use support::{engine, Server};
use tonic::Code;

/// Bytes no protobuf message decodes from: a varint that never ends, and a string field whose
/// length runs past the message.
fn garbage() -> [Vec<u8>; 2] {
    [vec![0xFF; 11], vec![0x0A, 0x64, b'a', b'b']]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_invalid_argument_on_every_worker_call() {
    let d = Server::start(
        engine(KvDtype::Nvfp4),
        v1::WorkerRole::Decode,
        "decode-0".into(),
    )
    .await;
    let calls = [
        ("/nibble.v1.Worker/Reserve", "ReserveRequest"),
        ("/nibble.v1.Worker/Prefill", "PrefillRequest"),
        ("/nibble.v1.Worker/Decode", "DecodeRequest"),
        ("/nibble.v1.Worker/Abort", "AbortRequest"),
        ("/nibble.v1.KvTransfer/PushPages", "PushPagesRequest"),
        ("/nibble.v1.KvTransfer/NcclPages", "NcclPagesRequest"),
    ];
    for (path, message) in calls {
        for bytes in garbage() {
            let status = raw::call(&d.address, path, vec![bytes]).await;
            assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
            let expected = format!("is not a valid {message}");
            assert!(status.message().contains(&expected), "{path}: {status:?}");
        }
    }
    // A well-formed message still goes through the same codec.
    let status = raw::call(&d.address, "/nibble.v1.Worker/Load", vec![Vec::new()]).await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    d.pages_back().await;
}

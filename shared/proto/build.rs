//! Generates the nibble.v1 messages, clients and servers from `proto/nibble/v1/*.proto`, and the
//! encoded file descriptor set that gRPC server reflection serves. Servers use nibble's codec
//! (`src/codec.rs`), clients tonic-prost's. Needs `protoc` (Debian package
//! protobuf-compiler), or the path of one in `PROTOC`.

use std::env;
use std::io;
use std::path::PathBuf;

const PROTOS: [&str; 4] = ["common", "inference", "worker", "transfer"];

fn main() -> io::Result<()> {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest_dir.join("../../proto");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let files: Vec<PathBuf> = PROTOS
        .iter()
        .map(|name| root.join(format!("nibble/v1/{name}.proto")))
        .collect();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let hint = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!("{e} (is protoc installed? apt-get install protobuf-compiler)"),
        )
    };
    // The messages and the servers, which decode requests with `crate::codec::ServerCodec`
    // (a malformed request is INVALID_ARGUMENT, not tonic-prost's INTERNAL).
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .codec_path("crate::codec::ServerCodec")
        // Page bytes decode as `bytes::Bytes` slices of the received buffer, not copies.
        .bytes(".nibble.v1.PushPagesRequest.data")
        .file_descriptor_set_path(out_dir.join("nibble_v1_descriptor.bin"))
        .compile_protos(&files, std::slice::from_ref(&root))
        .map_err(hint)?;
    // The clients, with prost's codec (a response that does not decode is INTERNAL), over the
    // messages above: in their own file, included next to them.
    let clients = out_dir.join("clients");
    std::fs::create_dir_all(&clients)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .extern_path(".nibble.v1", "crate::v1")
        .out_dir(&clients)
        .compile_protos(&files, &[root])
        .map_err(hint)
}

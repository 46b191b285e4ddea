//! The descriptor set that reflection serves: every service and RPC is there, and every message,
//! field, enum, enum value, service and RPC of `nibble.v1` carries a comment.

use std::collections::HashSet;

use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

fn descriptors() -> FileDescriptorSet {
    FileDescriptorSet::decode(nibble_proto::FILE_DESCRIPTOR_SET).expect("valid descriptor set")
}

fn nibble_files() -> Vec<FileDescriptorProto> {
    descriptors()
        .file
        .into_iter()
        .filter(|f| f.package() == "nibble.v1")
        .collect()
}

#[test]
fn services_and_methods() {
    let files = nibble_files();
    let mut methods: Vec<String> = files
        .iter()
        .flat_map(|f| f.service.iter())
        .flat_map(|s| {
            s.method
                .iter()
                .map(move |m| format!("{}.{}", s.name(), m.name()))
        })
        .collect();
    methods.sort();
    assert_eq!(
        methods,
        [
            "Inference.Generate",
            "Inference.ListModels",
            "Inference.Tokenize",
            "KvTransfer.NcclConnect",
            "KvTransfer.NcclPages",
            "KvTransfer.PushPages",
            "Worker.Abort",
            "Worker.Decode",
            "Worker.Info",
            "Worker.KvSnapshot",
            "Worker.Load",
            "Worker.Prefill",
            "Worker.Reserve",
            "Worker.SubscribeKvEvents",
        ]
    );
    let method = |service: &str, name: &str| {
        files
            .iter()
            .flat_map(|f| f.service.iter())
            .filter(|s| s.name() == service)
            .flat_map(|s| s.method.iter())
            .find(|m| m.name() == name)
            .cloned()
            .expect("method exists")
    };
    assert!(method("Inference", "Generate").server_streaming());
    assert!(method("Worker", "Decode").server_streaming());
    assert!(method("Worker", "SubscribeKvEvents").server_streaming());
    let push = method("KvTransfer", "PushPages");
    assert!(push.client_streaming() && !push.server_streaming());
    let nccl = method("KvTransfer", "NcclPages");
    assert!(!nccl.client_streaming() && nccl.server_streaming());
}

/// Paths (as in `SourceCodeInfo`) of every element that must be documented.
fn element_paths(file: &FileDescriptorProto) -> Vec<(Vec<i32>, String)> {
    // Field numbers of descriptor.proto.
    const FILE_MESSAGE: i32 = 4;
    const FILE_ENUM: i32 = 5;
    const FILE_SERVICE: i32 = 6;
    const MESSAGE_FIELD: i32 = 2;
    const MESSAGE_NESTED: i32 = 3;
    const MESSAGE_ENUM: i32 = 4;
    const MESSAGE_ONEOF: i32 = 8;
    const ENUM_VALUE: i32 = 2;
    const SERVICE_METHOD: i32 = 2;

    fn message(path: Vec<i32>, m: &DescriptorProto, out: &mut Vec<(Vec<i32>, String)>) {
        out.push((path.clone(), m.name().to_string()));
        let child = |kind: i32, i: usize| [path.clone(), vec![kind, i as i32]].concat();
        for (i, f) in m.field.iter().enumerate() {
            out.push((
                child(MESSAGE_FIELD, i),
                format!("{}.{}", m.name(), f.name()),
            ));
        }
        for (i, o) in m.oneof_decl.iter().enumerate() {
            out.push((
                child(MESSAGE_ONEOF, i),
                format!("{}.{}", m.name(), o.name()),
            ));
        }
        for (i, e) in m.enum_type.iter().enumerate() {
            out.push((child(MESSAGE_ENUM, i), format!("{}.{}", m.name(), e.name())));
        }
        for (i, nested) in m.nested_type.iter().enumerate() {
            // A `map` field's entry message is protoc's, with no source of its own.
            if !nested.options.as_ref().is_some_and(|o| o.map_entry()) {
                message(child(MESSAGE_NESTED, i), nested, out);
            }
        }
    }

    let mut out = Vec::new();
    for (i, m) in file.message_type.iter().enumerate() {
        // proto3 `optional` fields live in synthetic oneofs that have no comment of their own.
        let mut m = m.clone();
        m.oneof_decl.retain(|o| !o.name().starts_with('_'));
        message(vec![FILE_MESSAGE, i as i32], &m, &mut out);
    }
    for (i, e) in file.enum_type.iter().enumerate() {
        out.push((vec![FILE_ENUM, i as i32], e.name().to_string()));
        for (j, v) in e.value.iter().enumerate() {
            out.push((
                vec![FILE_ENUM, i as i32, ENUM_VALUE, j as i32],
                v.name().to_string(),
            ));
        }
    }
    for (i, s) in file.service.iter().enumerate() {
        out.push((vec![FILE_SERVICE, i as i32], s.name().to_string()));
        for (j, m) in s.method.iter().enumerate() {
            out.push((
                vec![FILE_SERVICE, i as i32, SERVICE_METHOD, j as i32],
                format!("{}.{}", s.name(), m.name()),
            ));
        }
    }
    out
}

#[test]
fn everything_is_documented() {
    let files = nibble_files();
    assert_eq!(files.len(), 4, "common, inference, worker, transfer");
    let mut undocumented = Vec::new();
    let mut checked = 0;
    for file in &files {
        let info = file
            .source_code_info
            .as_ref()
            .expect("the descriptor set keeps source info");
        let documented: HashSet<&[i32]> = info
            .location
            .iter()
            .filter(|l| !l.leading_comments().trim().is_empty())
            .map(|l| l.path.as_slice())
            .collect();
        for (path, name) in element_paths(file) {
            checked += 1;
            if !documented.contains(path.as_slice()) {
                undocumented.push(format!("{}: {name}", file.name()));
            }
        }
    }
    assert!(checked > 150, "checked only {checked} elements");
    assert!(undocumented.is_empty(), "undocumented: {undocumented:#?}");
}

#[test]
fn health_descriptors_are_valid_too() {
    let health = FileDescriptorSet::decode(tonic_health::pb::FILE_DESCRIPTOR_SET).unwrap();
    assert!(health.file.iter().any(|f| f.package() == "grpc.health.v1"));
}

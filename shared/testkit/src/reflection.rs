//! A gRPC server reflection client of both versions, as grpcurl and other tools use them: the
//! services a server lists, and whether it describes a symbol.

use tonic::transport::Channel;
use tonic::Status;
use tonic_reflection::pb::{v1, v1alpha};

/// The reflection protocol's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// `grpc.reflection.v1.ServerReflection`.
    V1,
    /// `grpc.reflection.v1alpha.ServerReflection` (what grpcurl 1.8 speaks).
    V1Alpha,
}

impl Version {
    pub const ALL: [Version; 2] = [Version::V1, Version::V1Alpha];
}

/// What a server answered through one version of reflection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reflected {
    /// The services it lists, sorted.
    pub services: Vec<String>,
    /// How many file descriptors it returned for the symbol asked about (0: none, or an error).
    pub symbol_files: usize,
}

/// Lists the services of the server on `channel` through reflection `version`, and asks it for
/// the file that defines `symbol` (e.g. `nibble.v1.Worker`).
pub async fn reflect(
    channel: Channel,
    version: Version,
    symbol: &str,
) -> Result<Reflected, Status> {
    let list = String::new();
    let symbol = symbol.to_string();
    match version {
        Version::V1 => {
            use v1::server_reflection_request::MessageRequest as Ask;
            use v1::server_reflection_response::MessageResponse as Answer;
            let ask = |message| v1::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(message),
            };
            let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
            let requests = vec![
                ask(Ask::ListServices(list)),
                ask(Ask::FileContainingSymbol(symbol)),
            ];
            let mut answers = client
                .server_reflection_info(tokio_stream::iter(requests))
                .await?
                .into_inner();
            let mut reflected = Reflected::default();
            while let Some(answer) = answers.message().await? {
                match answer.message_response {
                    Some(Answer::ListServicesResponse(list)) => {
                        reflected.services = list.service.into_iter().map(|s| s.name).collect();
                    }
                    Some(Answer::FileDescriptorResponse(files)) => {
                        reflected.symbol_files = files.file_descriptor_proto.len();
                    }
                    _ => {}
                }
            }
            reflected.services.sort();
            Ok(reflected)
        }
        Version::V1Alpha => {
            use v1alpha::server_reflection_request::MessageRequest as Ask;
            use v1alpha::server_reflection_response::MessageResponse as Answer;
            let ask = |message| v1alpha::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(message),
            };
            let mut client =
                v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
            let requests = vec![
                ask(Ask::ListServices(list)),
                ask(Ask::FileContainingSymbol(symbol)),
            ];
            let mut answers = client
                .server_reflection_info(tokio_stream::iter(requests))
                .await?
                .into_inner();
            let mut reflected = Reflected::default();
            while let Some(answer) = answers.message().await? {
                match answer.message_response {
                    Some(Answer::ListServicesResponse(list)) => {
                        reflected.services = list.service.into_iter().map(|s| s.name).collect();
                    }
                    Some(Answer::FileDescriptorResponse(files)) => {
                        reflected.symbol_files = files.file_descriptor_proto.len();
                    }
                    _ => {}
                }
            }
            reflected.services.sort();
            Ok(reflected)
        }
    }
}

/// The services every nibble server lists besides its own, sorted with `own` into what
/// [`reflect`] returns.
pub fn expected_services(own: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = own
        .iter()
        .chain(&[
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ])
        .map(|s| s.to_string())
        .collect();
    all.sort();
    all
}

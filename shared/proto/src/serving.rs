//! What every nibble gRPC server serves next to its own API: `grpc.health.v1` and server
//! reflection (v1) covering the `nibble.v1` services and the health service.

use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};

/// The reflection service, describing every `nibble.v1` file and `grpc.health.v1`.
pub fn reflection(
) -> Result<ServerReflectionServer<impl ServerReflection>, tonic_reflection::server::Error> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}

/// The health service and the reporter that sets its statuses. The overall status ("") starts
/// SERVING; a service marks itself with [`HealthReporter::set_serving`] once it is ready.
pub fn health() -> (HealthReporter, HealthServer<impl Health>) {
    tonic_health::server::health_reporter()
}

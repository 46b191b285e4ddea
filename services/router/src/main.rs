//! `nibble-router`: the router. Parses the command line and runs [`nibble_router::cli::run`].

use clap::Parser;
use nibble_router::cli::RouterArgs;

/// nibble's router: the public Inference API, placing requests on prefill and decode workers.
#[derive(Debug, Parser)]
#[command(name = "nibble-router", version)]
struct Cli {
    #[command(flatten)]
    router: RouterArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    nibble_telemetry::logging::init();
    nibble_router::cli::run(Cli::parse().router).await
}

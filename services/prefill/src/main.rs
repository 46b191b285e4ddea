//! `nibble-prefill`: a prefill worker. Parses the command line and runs [`nibble_worker::run`].

use clap::Parser;
use nibble_worker::WorkerArgs;

/// nibble's prefill worker.
#[derive(Debug, Parser)]
#[command(name = "nibble-prefill", version)]
struct Cli {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    nibble_worker::logging::init();
    let cli = Cli::parse();
    nibble_worker::run(nibble_worker::Role::Prefill, cli.worker).await?;
    Ok(())
}

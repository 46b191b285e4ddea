//! `nibble-decode`: a decode worker. Parses the command line and runs [`nibble_worker::run`].

use clap::Parser;
use nibble_worker::WorkerArgs;

/// nibble's decode worker.
#[derive(Debug, Parser)]
#[command(name = "nibble-decode", version)]
struct Cli {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    nibble_worker::logging::init();
    let cli = Cli::parse();
    nibble_worker::run(nibble_worker::Role::Decode, cli.worker).await?;
    Ok(())
}

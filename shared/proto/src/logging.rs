//! Logs of every nibble process: `tracing` events written to stderr, one line each.
//!
//! Colours only on a terminal. `RUST_LOG` filters them (default `info`; for example `RUST_LOG=nibble_worker=debug`), and
//! `NIBBLE_LOG_FORMAT=json` writes one JSON object per line for log collectors instead of text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the process's log subscriber (once; later calls do nothing).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("NIBBLE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // Err only when a subscriber is already installed: keep that one.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

//! Logs of every nibble process: `tracing` events written to stderr, one line each.
//!
//! Colours only on a terminal. `RUST_LOG` filters them (default `info`; for example `RUST_LOG=nibble_worker=debug`), and
//! `NIBBLE_LOG_FORMAT=json` writes one JSON object per line for log collectors instead of text.
//!
//! [`hold`] keeps the lines back while a command prints an answer on the same terminal
//! (`nibble up --prompt`), so no log line lands in the middle of it.

use std::io::{self, IsTerminal, Write};
use std::sync::Mutex;

use tracing_subscriber::EnvFilter;

/// Installs the process's log subscriber (once; later calls do nothing).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("NIBBLE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(io::stderr().is_terminal())
        .with_writer(|| Stderr);
    // Err only when a subscriber is already installed: keep that one.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Holds the process's log lines back, in order, until the returned guard is dropped; then
/// writes them. Past 1 MiB held, lines go straight out again: a hold never costs unbounded
/// memory or loses a line.
pub fn hold() -> Hold {
    STDERR_GATE.hold();
    Hold(())
}

/// While alive, log lines wait; see [`hold`].
#[must_use = "the hold ends when this is dropped"]
pub struct Hold(());

impl Drop for Hold {
    fn drop(&mut self) {
        let _ = STDERR_GATE.release(&mut io::stderr());
    }
}

static STDERR_GATE: Gate = Gate::new();

/// The subscriber's writer: stderr through the gate.
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        crate::progress::suspended(|| STDERR_GATE.write(buf, &mut io::stderr()))
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// Bytes pass through to a sink, or wait in a buffer while held.
struct Gate {
    held: Mutex<Option<Vec<u8>>>,
}

const MAX_HELD: usize = 1 << 20;

impl Gate {
    const fn new() -> Self {
        Gate {
            held: Mutex::new(None),
        }
    }

    fn hold(&self) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get_or_insert_with(Vec::new);
    }

    fn write(&self, buf: &[u8], sink: &mut impl Write) -> io::Result<usize> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        match held.as_mut() {
            Some(lines) if lines.len() + buf.len() <= MAX_HELD => {
                lines.extend_from_slice(buf);
                Ok(buf.len())
            }
            Some(lines) => {
                // Full: what waited goes out first, then this, and the hold is over.
                sink.write_all(lines)?;
                *held = None;
                sink.write_all(buf)?;
                Ok(buf.len())
            }
            None => sink.write(buf),
        }
    }

    fn release(&self, sink: &mut impl Write) -> io::Result<()> {
        let lines = self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
        match lines {
            Some(lines) => sink.write_all(&lines),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_pass_through_unless_held_and_come_out_in_order_on_release() {
        let gate = Gate::new();
        let mut sink = Vec::new();
        gate.write(b"one\n", &mut sink).unwrap();
        assert_eq!(sink, b"one\n");

        gate.hold();
        gate.write(b"two\n", &mut sink).unwrap();
        gate.write(b"three\n", &mut sink).unwrap();
        assert_eq!(sink, b"one\n", "nothing reaches the sink while held");

        gate.release(&mut sink).unwrap();
        assert_eq!(sink, b"one\ntwo\nthree\n");
        gate.write(b"four\n", &mut sink).unwrap();
        assert_eq!(sink, b"one\ntwo\nthree\nfour\n");
        // A release without a hold writes nothing.
        gate.release(&mut sink).unwrap();
        assert_eq!(sink, b"one\ntwo\nthree\nfour\n");
    }

    #[test]
    fn a_full_hold_lets_everything_out_in_order() {
        let gate = Gate::new();
        let mut sink = Vec::new();
        gate.hold();
        let line = vec![b'x'; MAX_HELD / 2];
        gate.write(&line, &mut sink).unwrap();
        gate.write(&line, &mut sink).unwrap();
        assert!(sink.is_empty());
        gate.write(b"!", &mut sink).unwrap();
        assert_eq!(sink.len(), MAX_HELD + 1);
        assert_eq!(sink.last(), Some(&b'!'));
        // The hold is over: later lines pass straight through.
        gate.write(b"?", &mut sink).unwrap();
        assert_eq!(sink.last(), Some(&b'?'));
    }
}

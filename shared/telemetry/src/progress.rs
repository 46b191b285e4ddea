//! Progress bars for the long steps a person waits on: the default model's download and
//! unpacking, and loading the weights.
//!
//! Bars draw on stderr only when it is a terminal and logs are text (`NIBBLE_LOG_FORMAT=json`
//! or a pipe draws nothing, so a log collector never sees control sequences). Every bar of the
//! process shares one [`MultiProgress`], and the log writer of [`crate::logging`] prints its lines
//! through [`suspended`], so a log line never tears a bar.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{self, IsTerminal};
use std::sync::OnceLock;

/// Whether bars draw: stderr is a terminal and logs are text.
fn drawing() -> bool {
    static DRAWING: OnceLock<bool> = OnceLock::new();
    *DRAWING.get_or_init(|| {
        let json = std::env::var("NIBBLE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
        io::stderr().is_terminal() && !json
    })
}

static BARS: OnceLock<MultiProgress> = OnceLock::new();

fn bars() -> &'static MultiProgress {
    BARS.get_or_init(|| {
        let target = if drawing() {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        };
        MultiProgress::with_draw_target(target)
    })
}

/// Runs `write` with every bar of the process cleared from the terminal, then redraws them.
pub fn suspended<R>(write: impl FnOnce() -> R) -> R {
    match BARS.get() {
        Some(bars) if drawing() => bars.suspend(write),
        _ => write(),
    }
}

/// What a bar counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes, shown as KiB/MiB/GiB with a rate.
    Bytes,
    /// Whole steps (layers, tensors), shown as `done/total`.
    Steps,
}

/// One bar; cleared when dropped. Hidden (every call does nothing visible) when bars do not
/// draw.
pub struct Bar(ProgressBar);

impl Bar {
    /// A bar labelled `label` that runs to `total` `unit`s.
    pub fn new(label: impl Into<String>, total: u64, unit: Unit) -> Self {
        let template = match unit {
            Unit::Bytes => {
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} ({elapsed})"
            }
            Unit::Steps => "{msg} [{bar:30}] {pos}/{len} ({elapsed})",
        };
        let style = ProgressStyle::with_template(template)
            .expect("the templates are valid")
            .progress_chars("=> ");
        let bar = bars().add(ProgressBar::new(total).with_style(style));
        bar.set_message(label.into());
        Self(bar)
    }

    /// A bar for work of unknown length: a spinner with the time so far, advanced by
    /// [`Bar::tick`] from the thread doing (or waiting on) the work. No thread of its own draws
    /// it, so a caller holding stderr's lock can never deadlock with a drawing thread.
    pub fn spinner(label: impl Into<String>) -> Self {
        let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .expect("the template is valid");
        let bar = bars().add(ProgressBar::new_spinner().with_style(style));
        bar.set_message(label.into());
        Self(bar)
    }

    /// Redraws a spinner's next frame and time (throttled to the draw rate).
    pub fn tick(&self) {
        self.0.tick();
    }

    /// Sets how much is done.
    pub fn set(&self, done: u64) {
        self.0.set_position(done);
    }

    /// Sets how much is done and the total, as the engine's weight loaders report them
    /// (`nibble_engine::LoadProgress`).
    pub fn track(&self, done: usize, total: usize) {
        self.0.set_length(total as u64);
        self.0.set_position(done as u64);
    }

    /// How much is done.
    pub fn position(&self) -> u64 {
        self.0.position()
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
        bars().remove(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_counts_whether_or_not_it_draws() {
        let bar = Bar::new("loading weights", 32, Unit::Steps);
        bar.set(10);
        assert_eq!(bar.position(), 10);
        bar.track(4, 31);
        assert_eq!(bar.position(), 4);
        let spinner = Bar::spinner("downloading");
        spinner.tick();
        assert_eq!(spinner.position(), 0);
        // Under `cargo test` stderr is captured, not a terminal: nothing draws.
        assert_eq!(suspended(|| 7), 7);
    }
}

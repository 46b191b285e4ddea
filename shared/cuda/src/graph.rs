//! CUDA graphs of decode steps: a decode step's ~350 launches recorded once and replayed as one
//! `cuGraphLaunch`, so the GPU runs them without the host between them.
//!
//! A step's launches depend on host state (page tables, context lengths, the tokens) only
//! through small device arrays ([`crate::backend`]'s `Uploaded` buffers) and through launch
//! arguments that change rarely (shapes, buffer addresses, the decode split planned for a
//! bucketed context length). So each step first runs its host code as a **dry pass**: every
//! `Uploaded` array is copied to the device as usual, but each kernel launch only appends its
//! function, grid and argument bytes to a record instead of running. A record equal to one
//! already captured means the step is that graph with new inputs: the graph is launched. A new
//! record is **captured**: the host code runs again with launches going to a capture stream
//! (`cuStreamBeginCapture`), and the graph is instantiated, kept, and launched. Anything a graph
//! cannot replay (cuBLAS, a device-to-device copy, an input array written twice in one step)
//! marks the dry pass as *blocked*, and the step runs eagerly instead.
//!
//! The pass is per thread ([`Pass`]): launches from other threads run as always, and capture
//! uses `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.

use std::cell::RefCell;
use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUstream};
use cudarc::driver::{DriverError, LaunchConfig};

/// What launches on this thread do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Launch on the device's stream (everything outside a graphed step).
    Eager,
    /// Append to the step's record; launch nothing.
    Dry,
    /// Launch on the capture stream, which records into a graph.
    Capture,
}

struct State {
    pass: Pass,
    /// Counts the passes begun on this thread: which pass an input array was written in.
    id: u64,
    /// The launches of the pass so far (see [`record_launch`]).
    record: Vec<u8>,
    /// Why the step cannot be a graph, if it cannot.
    blocked: Option<&'static str>,
    /// The stream a capture pass launches on.
    capture: CUstream,
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            pass: Pass::Eager,
            id: 0,
            record: Vec::new(),
            blocked: None,
            capture: ptr::null_mut(),
        })
    };
}

/// This thread's pass.
pub(crate) fn pass() -> Pass {
    STATE.with(|s| s.borrow().pass)
}

/// This thread's pass and its number (unique on the thread).
pub(crate) fn pass_id() -> (Pass, u64) {
    STATE.with(|s| {
        let s = s.borrow();
        (s.pass, s.id)
    })
}

/// The stream of this thread's capture pass.
pub(crate) fn capture_stream() -> CUstream {
    STATE.with(|s| s.borrow().capture)
}

/// Starts a pass on this thread with an empty record; `capture` is the stream of a capture pass.
pub(crate) fn begin(pass: Pass, capture: CUstream) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.pass = pass;
        s.id += 1;
        s.record.clear();
        s.blocked = None;
        s.capture = capture;
    });
}

/// Ends this thread's pass when dropped, unless [`end`] did: a pass that unwinds (a panic in
/// the step) must not leave the thread's launches recorded instead of run.
pub(crate) struct PassGuard;

impl Drop for PassGuard {
    fn drop(&mut self) {
        if pass() != Pass::Eager {
            let _ = end();
        }
    }
}

/// Ends this thread's pass (launches are eager again) and returns its record, or why the step
/// cannot be a graph.
pub(crate) fn end() -> Result<Vec<u8>, &'static str> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.pass = Pass::Eager;
        s.capture = ptr::null_mut();
        match s.blocked.take() {
            Some(why) => Err(why),
            None => Ok(std::mem::take(&mut s.record)),
        }
    })
}

/// Marks the step as one a graph cannot replay, because of `what` (an operation that is not a
/// kernel launch). Outside a pass it does nothing; in a dry pass the step then runs eagerly; in
/// a capture pass (which only follows a dry pass that was not blocked) it is an error.
pub(crate) fn block(what: &'static str) -> Result<(), crate::Error> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.pass {
            Pass::Eager => Ok(()),
            Pass::Dry => {
                s.blocked.get_or_insert(what);
                Ok(())
            }
            Pass::Capture => Err(crate::Error::Unsupported(format!(
                "{what} inside a captured decode step"
            ))),
        }
    })
}

/// Whether an operation that is not a kernel launch (cuBLAS, a device-to-device copy) runs now:
/// not in a dry pass, which records what a step launches and launches nothing. Such an
/// operation [`block`]s the step first, so the step then runs eagerly and does it there.
pub(crate) fn runs_now() -> bool {
    pass() != Pass::Dry
}

/// Appends one launch to the pass's record (a dry pass's, or a capture's, which must equal it):
/// the function, its configuration, whether it is programmatic, and every parameter's bytes
/// (device addresses and plain values alike).
pub(crate) fn record_launch<'p>(
    func: sys::CUfunction,
    cfg: &LaunchConfig,
    programmatic: bool,
    params: impl ExactSizeIterator<Item = &'p [u8]>,
) {
    STATE.with(|s| {
        let r = &mut s.borrow_mut().record;
        r.extend_from_slice(&(func as usize as u64).to_le_bytes());
        for v in [
            cfg.grid_dim.0,
            cfg.grid_dim.1,
            cfg.grid_dim.2,
            cfg.block_dim.0,
            cfg.block_dim.1,
            cfg.block_dim.2,
            cfg.shared_mem_bytes,
            programmatic as u32,
            params.len() as u32,
        ] {
            r.extend_from_slice(&v.to_le_bytes());
        }
        for p in params {
            r.extend_from_slice(&(p.len() as u32).to_le_bytes());
            r.extend_from_slice(p);
        }
    });
}

/// An instantiated graph and the graph it was made from.
struct Exec {
    graph: CUgraph,
    exec: CUgraphExec,
}

impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `StepGraphs::capture` and are destroyed once.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// The most graphs kept: one per batch size and context bucket in use, the least recently used
/// dropped first.
const KEPT: usize = 16;

/// The decode-step graphs of one device and the stream they are captured on.
pub(crate) struct StepGraphs {
    capture: CUstream,
    /// (record, graph), the most recently used first.
    graphs: Vec<(Vec<u8>, Exec)>,
}

// SAFETY: the raw stream and graph handles are only used under the backend's mutex, with the
// device's context bound to the calling thread.
unsafe impl Send for StepGraphs {}

impl StepGraphs {
    /// A capture stream of its own (non-blocking, so it never waits for the device's default
    /// stream), created in the current context. Not a cudarc stream: a second cudarc stream
    /// would turn on cudarc's per-buffer event tracking for the whole context.
    pub(crate) fn new() -> Result<Self, DriverError> {
        let mut capture = ptr::null_mut();
        // SAFETY: writes a new stream handle into `capture`.
        unsafe {
            sys::cuStreamCreate(
                &mut capture,
                sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32,
            )
        }
        .result()?;
        Ok(Self {
            capture,
            graphs: Vec::new(),
        })
    }

    pub(crate) fn capture_stream(&self) -> CUstream {
        self.capture
    }

    /// Launches the graph recorded as `record` on `stream`, if there is one.
    pub(crate) fn launch_kept(
        &mut self,
        record: &[u8],
        stream: CUstream,
    ) -> Result<bool, DriverError> {
        let Some(i) = self.graphs.iter().position(|(r, _)| r == record) else {
            return Ok(false);
        };
        let kept = self.graphs.remove(i);
        // SAFETY: the exec is alive (owned by `kept`); stream-ordered after earlier work.
        let launched = unsafe { sys::cuGraphLaunch(kept.1.exec, stream) }.result();
        self.graphs.insert(0, kept);
        launched.map(|()| true)
    }

    /// Begins capturing this thread's launches on the capture stream.
    pub(crate) fn begin_capture(&self) -> Result<(), DriverError> {
        // SAFETY: the capture stream is alive; thread-local mode leaves other threads alone.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                self.capture,
                sys::CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .result()
    }

    /// Ends the capture begun by [`Self::begin_capture`]; when `keep` is `Some(record)`,
    /// instantiates the graph, launches it on `stream` and keeps it under `record`. Without
    /// `keep` (the pass failed) the captured graph is discarded.
    pub(crate) fn end_capture(
        &mut self,
        keep: Option<Vec<u8>>,
        stream: CUstream,
    ) -> Result<(), DriverError> {
        let mut graph: CUgraph = ptr::null_mut();
        // SAFETY: ends the capture begun on this stream by this thread.
        let ended = unsafe { sys::cuStreamEndCapture(self.capture, &mut graph) }.result();
        let destroy = |g: CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph returned by the capture, destroyed once.
                unsafe {
                    let _ = sys::cuGraphDestroy(g);
                }
            }
        };
        let Some(record) = keep else {
            destroy(graph);
            return ended;
        };
        if let Err(e) = ended {
            destroy(graph);
            return Err(e);
        }
        let mut exec: CUgraphExec = ptr::null_mut();
        // SAFETY: `graph` is the captured graph; `exec` receives its instance.
        if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
            destroy(graph);
            return Err(e);
        }
        let kept = Exec { graph, exec };
        // SAFETY: the instance is alive (owned by `kept`).
        unsafe { sys::cuGraphLaunch(kept.exec, stream) }.result()?;
        self.graphs.insert(0, (record, kept));
        self.graphs.truncate(KEPT);
        Ok(())
    }
}

impl Drop for StepGraphs {
    fn drop(&mut self) {
        self.graphs.clear();
        // SAFETY: the stream was created by `new` and is destroyed once.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.capture);
        }
    }
}

/// The context length a decode step plans its split for, and the width of its page-table rows:
/// `max_context` rounded up to a multiple of 1/32 of the next power of two (at least 256
/// tokens), so that a graph captured at one length serves the next thousand-odd steps (2,048
/// at 32K) for at most 1/32 more planned work. Every sequence's own length stays exact (it is
/// read from the device); only the split plan and the row width see the bucket.
pub(crate) fn context_bucket(max_context: usize) -> usize {
    let step = (max_context.max(1).next_power_of_two() / 32).max(256);
    max_context.max(1).next_multiple_of(step)
}

/// The bytes of a plain value, for [`record_launch`].
///
/// # Safety
///
/// `ptr` must point to `len` initialized bytes.
pub(crate) unsafe fn value_bytes<'a>(ptr: *const c_void, len: usize) -> &'a [u8] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(x: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (x, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    #[test]
    fn a_dry_pass_records_launches_and_equal_steps_record_equal_bytes() {
        let step = |grid: u32, arg: u64| {
            begin(Pass::Dry, ptr::null_mut());
            assert_eq!(pass(), Pass::Dry);
            record_launch(
                ptr::null_mut(),
                &cfg(grid),
                true,
                [&arg.to_le_bytes()[..]].into_iter(),
            );
            record_launch(ptr::null_mut(), &cfg(1), false, std::iter::empty());
            end().expect("not blocked")
        };
        let a = step(8, 42);
        assert_eq!(pass(), Pass::Eager);
        assert!(!a.is_empty());
        assert_eq!(a, step(8, 42));
        assert_ne!(a, step(9, 42), "the grid is part of the record");
        assert_ne!(a, step(8, 43), "so are the arguments");
    }

    #[test]
    fn blocking_operations_end_a_dry_pass_eagerly_and_fail_a_capture() {
        assert!(block("cuBLAS").is_ok(), "outside a pass: nothing to do");
        begin(Pass::Dry, ptr::null_mut());
        block("cuBLAS").unwrap();
        block("a device-to-device copy").unwrap();
        assert!(!runs_now(), "a dry pass does no work");
        assert_eq!(end(), Err("cuBLAS"), "the first reason is kept");
        assert!(runs_now(), "outside a pass everything runs");
        begin(Pass::Dry, ptr::null_mut());
        assert!(end().is_ok(), "a new pass starts unblocked");
        begin(Pass::Capture, ptr::null_mut());
        let err = block("cuBLAS").unwrap_err().to_string();
        assert!(
            err.contains("cuBLAS inside a captured decode step"),
            "{err}"
        );
        end().unwrap();
    }

    #[test]
    fn passes_are_per_thread() {
        begin(Pass::Dry, ptr::null_mut());
        std::thread::spawn(|| assert_eq!(pass(), Pass::Eager))
            .join()
            .unwrap();
        end().unwrap();
    }

    #[test]
    fn context_buckets_cover_the_context_with_little_slack() {
        for ctx in [
            1, 16, 255, 256, 257, 4_096, 4_097, 32_768, 32_769, 131_072, 200_000,
        ] {
            let b = context_bucket(ctx);
            assert!(b >= ctx, "{ctx} -> {b}");
            assert_eq!(b % 256, 0, "whole pages of any size up to 256");
            assert!(b - ctx < 256 || (b - ctx) * 32 <= ctx.next_power_of_two());
        }
        // A graph at 32K serves the next 2,048 steps.
        assert_eq!(context_bucket(32_769), 34_816);
        assert_eq!(context_bucket(34_816), 34_816);
        assert_eq!(context_bucket(4_097), 4_352);
        assert_eq!(context_bucket(1), 256);
    }
}

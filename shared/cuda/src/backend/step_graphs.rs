//! Decode steps as CUDA graphs ([`crate::graph`] says how): the backend's side of
//! `Backend::decode_layers`, switched by `NIBBLE_CUDA_GRAPHS` or
//! [`CudaBackend::set_decode_graphs`].

use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use nibble_engine::Result as EngineResult;

use super::{device_err, CudaBackend};
use crate::graph::{self, Pass, StepGraphs};
use crate::{Error, Result};

/// The environment variable that turns decode-step graphs on (`1`) or off (`0`).
pub const GRAPHS_ENV: &str = "NIBBLE_CUDA_GRAPHS";

/// Whether decode steps run as graphs when [`GRAPHS_ENV`] is unset.
const BY_DEFAULT: bool = false;

/// How many decode steps ran which way (see [`CudaBackend::decode_graph_counts`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphCounts {
    /// Steps that launched a graph kept from an earlier step.
    pub replayed: u64,
    /// Steps captured into a new graph (and launched).
    pub captured: u64,
    /// Steps run launch by launch although graphs were on (cuBLAS GEMMs of 17 rows and more, a
    /// step of mixed sequences, a context with several streams).
    pub eager: u64,
}

/// The decode-step graphs of a backend.
pub(super) struct Graphs {
    on: AtomicBool,
    kept: Mutex<Option<StepGraphs>>,
    replayed: AtomicU64,
    captured: AtomicU64,
    eager: AtomicU64,
    /// Why steps ran eagerly, each logged once.
    noted: Mutex<Vec<&'static str>>,
}

impl Graphs {
    /// Graphs as [`GRAPHS_ENV`] says: unset is the default, anything but `0` or `1` an error
    /// naming the variable.
    pub(super) fn from_env() -> Result<Self> {
        Self::from_var(std::env::var(GRAPHS_ENV))
    }

    fn from_var(var: std::result::Result<String, std::env::VarError>) -> Result<Self> {
        let on = match var {
            Err(std::env::VarError::NotPresent) => BY_DEFAULT,
            Ok(v) if v == "1" => true,
            Ok(v) if v == "0" => false,
            Ok(v) => {
                return Err(Error::Unsupported(format!(
                    "{GRAPHS_ENV}={v:?} (expected 0 or 1)"
                )))
            }
            Err(e) => return Err(Error::Unsupported(format!("{GRAPHS_ENV}: {e}"))),
        };
        Ok(Self {
            on: AtomicBool::new(on),
            kept: Mutex::new(None),
            replayed: AtomicU64::new(0),
            captured: AtomicU64::new(0),
            eager: AtomicU64::new(0),
            noted: Mutex::new(Vec::new()),
        })
    }

    fn note_eager(&self, why: &'static str) {
        self.eager.fetch_add(1, Ordering::Relaxed);
        let mut noted = self.noted.lock().unwrap_or_else(PoisonError::into_inner);
        if !noted.contains(&why) {
            noted.push(why);
            tracing::info!("decode steps with {why} run without a CUDA graph");
        }
    }
}

impl CudaBackend {
    /// Turns decode-step graphs on or off (they start as [`GRAPHS_ENV`] says). Tokens are the
    /// same either way: the graph replays exactly the launches of the step.
    pub fn set_decode_graphs(&self, on: bool) {
        self.graphs.on.store(on, Ordering::Relaxed);
    }

    /// Whether decode steps run as graphs.
    pub fn decode_graphs(&self) -> bool {
        self.graphs.on.load(Ordering::Relaxed)
    }

    /// How many decode steps replayed a graph, were captured, or ran eagerly with graphs on.
    pub fn decode_graph_counts(&self) -> GraphCounts {
        GraphCounts {
            replayed: self.graphs.replayed.load(Ordering::Relaxed),
            captured: self.graphs.captured.load(Ordering::Relaxed),
            eager: self.graphs.eager.load(Ordering::Relaxed),
        }
    }

    /// `Backend::decode_layers`: a dry pass, then the kept graph of an equal record, or a
    /// capture of a new one, or (when something in the step cannot be replayed) the step run
    /// launch by launch.
    pub(super) fn graphed_decode(
        &self,
        layers: &mut dyn FnMut() -> EngineResult<()>,
    ) -> EngineResult<()> {
        if !self.decode_graphs() {
            return layers();
        }
        // With several streams cudarc orders buffers across them by events recorded at each
        // launch, which a replayed graph would not record.
        if self.kernels.context().is_managing_stream_synchronization() {
            self.graphs
                .note_eager("several streams on the device (NCCL page transfers)");
            return layers();
        }
        self.bind();
        let _guard = graph::PassGuard;
        graph::begin(Pass::Dry, ptr::null_mut());
        let dry = layers();
        let record = graph::end();
        dry?;
        let record = match record {
            Ok(record) => record,
            Err(why) => {
                self.graphs.note_eager(why);
                return layers();
            }
        };
        let stream = self.stream().cu_stream();
        let mut kept = self
            .graphs
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let graphs = match &mut *kept {
            Some(graphs) => graphs,
            empty => empty.insert(
                StepGraphs::new().map_err(|e| device_err("creating the capture stream", e))?,
            ),
        };
        if graphs
            .launch_kept(&record, stream)
            .map_err(|e| device_err("graph launch", e))?
        {
            self.graphs.replayed.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        graphs
            .begin_capture()
            .map_err(|e| device_err("beginning a graph capture", e))?;
        graph::begin(Pass::Capture, graphs.capture_stream());
        let captured = layers();
        let again = graph::end();
        if let Err(e) = captured {
            let _ = graphs.end_capture(None, stream);
            return Err(e);
        }
        if again.as_ref() != Ok(&record) {
            graphs
                .end_capture(None, stream)
                .map_err(|e| device_err("ending a graph capture", e))?;
            drop(kept);
            self.graphs
                .note_eager("launches that differ between two passes over the same inputs");
            return layers();
        }
        match graphs.end_capture(Some(record), stream) {
            Ok(()) => {
                self.graphs.captured.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                // The capture or its instantiation failed: nothing of the step ran. Run it
                // launch by launch, and stop trying on this device.
                drop(kept);
                tracing::warn!("CUDA graph capture failed ({e}); decode steps run without graphs");
                self.set_decode_graphs(false);
                layers()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::env::VarError;

    #[test]
    fn the_variable_turns_graphs_on_or_off_and_anything_else_is_refused() {
        let on = |v: std::result::Result<String, VarError>| {
            Graphs::from_var(v).map(|g| g.on.load(Ordering::Relaxed))
        };
        assert_eq!(on(Err(VarError::NotPresent)).unwrap(), BY_DEFAULT);
        assert!(on(Ok("1".into())).unwrap());
        assert!(!on(Ok("0".into())).unwrap());
        let err = on(Ok("yes".into())).unwrap_err().to_string();
        assert!(err.contains("NIBBLE_CUDA_GRAPHS=\"yes\""), "{err}");
    }

    #[test]
    fn each_reason_to_run_eagerly_is_counted() {
        let g = Graphs::from_var(Ok("1".into())).unwrap();
        g.note_eager("cuBLAS");
        g.note_eager("cuBLAS");
        assert_eq!(g.eager.load(Ordering::Relaxed), 2);
        assert_eq!(g.noted.lock().unwrap().len(), 1);
    }
}

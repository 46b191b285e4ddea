//! [`Device`]: the `--device cpu|cuda|auto` choice of the command line and the workers.

use std::fmt;
use std::str::FromStr;

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU reference backend.
    Cpu,
    /// [`crate::CudaBackend`] on GPU 0; failing to start it is an error.
    Cuda,
    /// CUDA when a driver with a device is found and the backend starts; the CPU otherwise.
    /// The default: a GPU machine uses its GPU without being told.
    #[default]
    Auto,
}

impl Device {
    pub const ALL: [Device; 3] = [Device::Cpu, Device::Cuda, Device::Auto];

    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Auto => "auto",
        }
    }

    /// Whether to try CUDA: always for `cuda`, for `auto` when a device is present.
    pub fn wants_cuda(self) -> bool {
        match self {
            Device::Cpu => false,
            Device::Cuda => true,
            Device::Auto => crate::cuda_available(),
        }
    }

    /// [`wants_cuda`](Self::wants_cuda) for a model whose KV cache has these needs: `auto`
    /// stays on the CPU (saying why on the log) when the CUDA backend cannot run them, so a GPU
    /// machine never turns a working default into an error. `cuda` tries anyway and fails with
    /// the backend's reason.
    pub fn wants_cuda_for(self, kv: KvNeeds) -> bool {
        if self != Device::Auto || !self.wants_cuda() {
            return self.wants_cuda();
        }
        match kv.unsupported() {
            Some(reason) => {
                tracing::info!("--device auto: using the CPU, {reason}");
                false
            }
            None => true,
        }
    }
}

/// What a model's KV cache asks of the attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvNeeds {
    pub head_dim: usize,
    pub page_size: usize,
    pub hadamard: bool,
}

impl KvNeeds {
    /// Why the CUDA backend cannot run this cache, if it cannot (the same checks as
    /// `CudaBackend::new_pages`).
    pub fn unsupported(self) -> Option<String> {
        if self.hadamard {
            return Some("the CUDA backend does not implement the Hadamard KV rotation".into());
        }
        if !matches!(self.head_dim, 64 | 128) {
            return Some(format!(
                "the CUDA attention kernels take head dim 64 or 128, not {}",
                self.head_dim
            ));
        }
        if self.page_size < crate::launch::DECODE_TILE {
            return Some(format!(
                "the CUDA decode kernel reads pages of at least {} tokens, not {}",
                crate::launch::DECODE_TILE,
                self.page_size
            ));
        }
        None
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Device::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown device {s:?} (expected cpu, cuda or auto)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_its_names() {
        for d in Device::ALL {
            assert_eq!(d.name().parse::<Device>().unwrap(), d);
        }
        assert!("gpu".parse::<Device>().is_err());
        assert!(!Device::Cpu.wants_cuda());
        assert!(Device::Cuda.wants_cuda());
        assert_eq!(Device::default(), Device::Auto);
    }

    #[test]
    fn names_what_the_cuda_backend_cannot_run() {
        let ok = KvNeeds {
            head_dim: 128,
            page_size: 16,
            hadamard: false,
        };
        assert_eq!(ok.unsupported(), None);
        assert_eq!(KvNeeds { head_dim: 64, ..ok }.unsupported(), None);
        let reason = |kv: KvNeeds| kv.unsupported().unwrap();
        assert!(reason(KvNeeds {
            hadamard: true,
            ..ok
        })
        .contains("Hadamard"));
        assert!(reason(KvNeeds { head_dim: 96, ..ok }).contains("head dim 64 or 128, not 96"));
        assert!(reason(KvNeeds { page_size: 8, ..ok }).contains("not 8"));
        // `cpu` never asks; `cuda` always does, and fails later with the backend's reason.
        let bad = KvNeeds { head_dim: 96, ..ok };
        assert!(!Device::Cpu.wants_cuda_for(ok));
        assert!(Device::Cuda.wants_cuda_for(bad));
        assert!(!Device::Auto.wants_cuda_for(bad));
    }
}

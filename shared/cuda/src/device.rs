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

    /// The backend this choice gives a model whose KV cache has `kv`'s needs: a started
    /// [`CudaBackend`](crate::CudaBackend) on GPU 0, or `None` for the CPU. `cuda` that cannot
    /// start is an error. `auto` never turns a working default into an error: without a GPU it
    /// is the CPU, and when it finds a GPU but passes it by (a cache the kernels cannot run, a
    /// backend that fails to start) it calls `note` with why before settling on the CPU.
    pub fn start(
        self,
        kv: KvNeeds,
        note: impl FnOnce(&str),
    ) -> crate::Result<Option<crate::CudaBackend>> {
        if !self.wants_cuda() {
            return Ok(None);
        }
        if self == Device::Cuda {
            if let Some(reason) = kv.unsupported() {
                return Err(crate::Error::Unsupported(reason));
            }
            return crate::CudaBackend::new(0).map(Some);
        }
        if let Some(reason) = kv.unsupported() {
            note(&format!("a GPU was found but {reason}"));
            return Ok(None);
        }
        match crate::CudaBackend::new(0) {
            Ok(backend) => Ok(Some(backend)),
            Err(e) => {
                note(&format!("CUDA unavailable ({e})"));
                Ok(None)
            }
        }
    }
}

/// A GPU's memory as the driver reports it at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: usize,
    pub total: usize,
}

impl DeviceMemory {
    /// The memory of `context`'s GPU now (every process's allocations counted).
    pub fn of(context: &cudarc::driver::CudaContext) -> crate::Result<DeviceMemory> {
        context.bind_to_thread()?;
        let (free, total) = cudarc::driver::result::mem_get_info()?;
        Ok(DeviceMemory { free, total })
    }
}

/// What a model and its KV cache ask of the attention kernels: the one capability check, made
/// when `--device` picks a backend ([`Device::start`]), and again by the kernels that depend on
/// each part (pages by `CudaBackend::new_pages`, the query group by the decode launch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvNeeds {
    pub head_dim: usize,
    pub page_size: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
}

impl KvNeeds {
    /// The needs of `model` with pages of `page_size` tokens.
    pub fn of(model: &nibble_engine::ModelConfig, page_size: usize) -> Self {
        Self {
            head_dim: model.head_dim,
            page_size,
            q_heads: model.num_heads,
            kv_heads: model.num_kv_heads,
        }
    }

    /// Why the CUDA backend cannot run this model and cache, if it cannot.
    pub fn unsupported(self) -> Option<String> {
        pages_unsupported(self.head_dim, self.page_size)
            .or_else(|| group_unsupported(self.q_heads, self.kv_heads))
    }
}

/// Why the CUDA kernels cannot hold pages of `head_dim`-value vectors, `page_size` tokens each.
pub(crate) fn pages_unsupported(head_dim: usize, page_size: usize) -> Option<String> {
    if !matches!(head_dim, 64 | 128) {
        return Some(format!(
            "the CUDA attention kernels take head dim 64 or 128, not {head_dim}"
        ));
    }
    if page_size < crate::launch::DECODE_TILE {
        return Some(format!(
            "the CUDA decode kernel reads pages of at least {} tokens, not {page_size}",
            crate::launch::DECODE_TILE
        ));
    }
    None
}

/// Why the CUDA decode kernel cannot read `q_heads` query heads over `kv_heads` KV heads.
pub(crate) fn group_unsupported(q_heads: usize, kv_heads: usize) -> Option<String> {
    if q_heads == 0 || kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) || q_heads / kv_heads > 8
    {
        return Some(format!(
            "the CUDA decode kernel reads groups of 1 to 8 query heads per KV head, not \
             {q_heads} query heads over {kv_heads} KV heads"
        ));
    }
    None
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
            q_heads: 32,
            kv_heads: 8,
        };
        assert_eq!(ok.unsupported(), None);
        assert_eq!(KvNeeds { head_dim: 64, ..ok }.unsupported(), None);
        let reason = |kv: KvNeeds| kv.unsupported().unwrap();
        assert!(reason(KvNeeds { head_dim: 96, ..ok }).contains("head dim 64 or 128, not 96"));
        assert!(reason(KvNeeds { page_size: 8, ..ok }).contains("not 8"));
        let wide = KvNeeds { q_heads: 96, ..ok };
        assert!(
            reason(wide).contains("96 query heads over 8 KV heads"),
            "{wide:?}"
        );
        assert!(KvNeeds { q_heads: 12, ..ok }.unsupported().is_some());
        // `cpu` never starts CUDA; `auto` passes a GPU by for a cache it cannot run (here, or on
        // a machine with no GPU, it settles on the CPU either way).
        let bad = KvNeeds { head_dim: 96, ..ok };
        assert!(Device::Cpu
            .start(ok, |_| panic!("no note"))
            .unwrap()
            .is_none());
        assert!(Device::Auto.start(bad, |_| {}).unwrap().is_none());
        // `cuda` always tries: without a GPU that is an error, never a quiet CPU.
        if !crate::cuda_available() {
            assert!(Device::Cuda.start(ok, |_| panic!("no note")).is_err());
        }
        // `cuda` refuses what the kernels cannot run before it starts anything.
        let err = Device::Cuda
            .start(wide, |_| panic!("no note"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("groups of 1 to 8"), "{err}");
    }
}

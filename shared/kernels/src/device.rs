//! [`Device`]: the `--device cpu|cuda|auto` choice of the command line and the workers.

use std::fmt;
use std::str::FromStr;

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU reference backend.
    #[default]
    Cpu,
    /// [`crate::CudaBackend`] on GPU 0; failing to start it is an error.
    Cuda,
    /// CUDA when a driver with a device is found and the backend starts; the CPU otherwise.
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
    }
}

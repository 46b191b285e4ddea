//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch where the
//! device has it (sm_90 and newer): a kernel may be scheduled while the kernel before it in the
//! stream finishes, and waits for it on the device (`grid_dependency_sync` in `cu/common.cuh`,
//! the first statement of every kernel). The launch latency and block scheduling of each of a
//! decode step's ~350 kernels then overlap the tail of the one before, where a plain launch
//! starts only after the previous kernel has drained.
//!
//! [`Launch`] is built like cudarc's `LaunchArgs` (`.arg(..)` per kernel parameter, then an
//! unsafe `launch`), and keeps cudarc's cross-stream ordering: device buffers are taken through
//! `DevicePtr`/`DevicePtrMut`, which wait for and record the buffers' events when the context
//! tracks them.

use std::ffi::c_void;

use crate::graph::{self, Pass};
use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig, SyncOnDrop,
};

/// Room for the kernel parameters of the largest signature (`kv_quantize`: 14; the test below
/// counts every kernel's).
const MAX_PARAMS: usize = 16;

#[derive(Clone, Copy)]
enum Param {
    /// The address and size of a host value the builder borrows.
    Host(*const c_void, usize),
    /// A device pointer, held by the builder: its address is taken at launch.
    Device(sys::CUdeviceptr),
}

/// One kernel launch being built: see the module docs.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    programmatic: bool,
    params: [Param; MAX_PARAMS],
    len: usize,
    /// Event records owed to buffers when the context tracks them, made after the launch.
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `stream`; `programmatic` where the device supports programmatic
    /// dependent launch (and it was not turned off).
    pub(crate) fn new(stream: &'a CudaStream, func: &'a CudaFunction, programmatic: bool) -> Self {
        Self {
            stream,
            func,
            programmatic,
            params: [Param::Device(0); MAX_PARAMS],
            len: 0,
            guards: Vec::new(),
        }
    }

    fn push(&mut self, p: Param) -> &mut Self {
        assert!(
            self.len < MAX_PARAMS,
            "a kernel with more than {MAX_PARAMS} parameters"
        );
        self.params[self.len] = p;
        self.len += 1;
        self
    }

    fn device(&mut self, ptr: sys::CUdeviceptr, guard: SyncOnDrop<'a>) -> &mut Self {
        if self.stream.context().is_managing_stream_synchronization() {
            self.guards.push(guard);
        }
        self.push(Param::Device(ptr))
    }

    /// Submits the kernel to the stream. Takes the builder, so the buffers it borrows are free
    /// again after the call.
    ///
    /// # Safety
    ///
    /// The parameters pushed must match the kernel's signature in number, order and type, and
    /// the kernel must stay within the buffers it is given (as for cudarc's `LaunchArgs::launch`).
    ///
    /// In a dry pass of a decode-step graph (`crate::graph`) the launch is only recorded; in a
    /// capture pass it goes to the capture stream.
    pub(crate) unsafe fn launch(self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let pass = graph::pass();
        if pass != Pass::Eager {
            // Both passes record: the capture's record must equal the dry pass's.
            let params = self.params[..self.len].iter().map(|p| match p {
                // SAFETY: the builder borrows the value, of this size, until the launch.
                Param::Host(v, len) => unsafe { graph::value_bytes(*v, *len) },
                Param::Device(d) => {
                    // SAFETY: a CUdeviceptr is plain bytes, held in `self.params`.
                    unsafe { graph::value_bytes((d as *const sys::CUdeviceptr).cast(), 8) }
                }
            });
            graph::record_launch(self.func.cu_function(), &cfg, self.programmatic, params);
            if pass == Pass::Dry {
                return Ok(());
            }
        }
        self.stream.context().bind_to_thread()?;
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_PARAMS];
        for (slot, p) in ptrs.iter_mut().zip(&self.params[..self.len]) {
            *slot = match p {
                Param::Host(v, _) => *v as *mut c_void,
                Param::Device(d) => d as *const sys::CUdeviceptr as *mut c_void,
            };
        }
        // SAFETY: an all-zero attribute is a valid C struct (id IGNORE); its fields are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: match pass {
                Pass::Capture => graph::capture_stream(),
                _ => self.stream.cu_stream(),
            },
            attrs: if self.programmatic {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: self.programmatic as u32,
        };
        // SAFETY: `ptrs` holds one pointer per kernel parameter (the caller's promise), each to a
        // value alive for this call: host values the builder borrows for 'a, device pointers in
        // `self.params`, which stays in place until `self` drops at the end.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        // The buffers' events are recorded after the launch (as cudarc's launch does), when
        // `self` and its guards drop here.
        Ok(())
    }
}

/// A kernel parameter [`Launch::arg`] takes: a device buffer (by `&` for reading, `&mut` for
/// writing; `Option<&mut CudaSlice>` for an output the kernel skips when given null) or a plain
/// value (`u32`, `u64`, `f32` and the `#[repr(C)]` argument structs).
pub(crate) trait KernelParam<'a> {
    fn push_to(self, launch: &mut Launch<'a>);
}

impl<'a> Launch<'a> {
    pub(crate) fn arg<P: KernelParam<'a>>(&mut self, p: P) -> &mut Self {
        p.push_to(self);
        self
    }
}

/// Plain values, passed by address (the builder borrows them until the launch).
macro_rules! value_params {
    ($($t:ty),*) => {$(
        impl<'a> KernelParam<'a> for &'a $t {
            fn push_to(self, launch: &mut Launch<'a>) {
                let size = std::mem::size_of::<$t>();
                launch.push(Param::Host(self as *const $t as *const c_void, size));
            }
        }
    )*};
}
value_params!(
    u32,
    u64,
    f32,
    crate::PageGeom,
    crate::WindowGeom,
    crate::launch::DecodeArgs,
    crate::launch::prefill::PrefillArgs,
    crate::launch::prefill::TensorMap
);

impl<'a, T> KernelParam<'a> for &'a CudaSlice<T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (ptr, guard) = self.device_ptr(launch.stream);
        launch.device(ptr, guard);
    }
}

impl<'a, T> KernelParam<'a> for &'a mut CudaSlice<T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (ptr, guard) = self.device_ptr_mut(launch.stream);
        launch.device(ptr, guard);
    }
}

/// An optional output buffer: `None` passes a null pointer.
impl<'a, T> KernelParam<'a> for Option<&'a mut CudaSlice<T>> {
    fn push_to(self, launch: &mut Launch<'a>) {
        match self {
            Some(buf) => buf.push_to(launch),
            None => {
                launch.push(Param::Device(0));
            }
        }
    }
}

/// An optional input: `None` passes a null pointer.
impl<'a, T> KernelParam<'a> for Option<&'a CudaView<'_, T>> {
    fn push_to(self, launch: &mut Launch<'a>) {
        match self {
            Some(view) => view.push_to(launch),
            None => {
                launch.push(Param::Device(0));
            }
        }
    }
}

impl<'a, T> KernelParam<'a> for &'a CudaView<'_, T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (ptr, guard) = self.device_ptr(launch.stream);
        launch.device(ptr, guard);
    }
}

impl<'a, T> KernelParam<'a> for &'a mut CudaViewMut<'_, T> {
    fn push_to(self, launch: &mut Launch<'a>) {
        let (ptr, guard) = self.device_ptr_mut(launch.stream);
        launch.device(ptr, guard);
    }
}

#[cfg(test)]
mod tests {
    use super::MAX_PARAMS;

    /// Each `__global__` kernel's name and parameter count in `source` (macro-defined kernels
    /// counted once, under the macro's parameter name).
    fn signatures(source: &str) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        for (at, _) in source.match_indices("__global__ void") {
            let mut rest =
                source[at + "__global__ void".len()..].trim_start_matches(['\\', ' ', '\n']);
            if let Some(r) = rest.strip_prefix("__launch_bounds__(") {
                rest = &r[r.find(')').expect("closed") + 1..];
            }
            let rest = rest.trim_start_matches(['\\', ' ', '\n']);
            let open = rest.find('(').expect("a parameter list");
            let name = rest[..open].trim().to_string();
            let (mut depth, mut params) = (0, 1);
            for c in rest[open..].chars() {
                match c {
                    '(' => depth += 1,
                    ')' if depth == 1 => break,
                    ')' => depth -= 1,
                    ',' if depth == 1 => params += 1,
                    _ => {}
                }
            }
            out.push((name, params));
        }
        out
    }

    #[test]
    fn every_kernel_fits_a_launch() {
        let mut sources: Vec<&str> = crate::SOURCES.iter().map(|(_, s)| *s).collect();
        sources.push(crate::HOPPER_SOURCE.1);
        sources.push(crate::backend::OPS_SOURCE);
        let all: Vec<(String, usize)> = sources.iter().flat_map(|s| signatures(s)).collect();
        assert!(all.len() > 20, "found the kernels: {all:?}");
        let largest = all.iter().max_by_key(|(_, n)| *n).unwrap();
        assert!(largest.1 >= 12, "{largest:?}");
        for (name, params) in &all {
            assert!(*params <= MAX_PARAMS, "{name} takes {params} parameters");
        }
    }
}

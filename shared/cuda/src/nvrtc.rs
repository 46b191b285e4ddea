//! Finding NVRTC and compiling the kernel sources with it.
//!
//! cudarc opens `libnvrtc` by name at first use, so the dynamic loader must be able to find it.
//! [`load`] makes that so without `LD_LIBRARY_PATH`: it opens the library (and its builtins) by
//! absolute path first, after which the by-name lookup matches the already-loaded SONAME. Where
//! it looks is `crate::libs`'s order: `NIBBLE_NVRTC_LIB` (the library or its directory), the
//! loader's search path, the PyPI wheel `nvidia-cuda-nvrtc` (`nvidia/cu13/lib`, or
//! `nvidia/cuda_nvrtc/lib` for CUDA 12), `/usr/local/cuda/lib64`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::libs::Search;
use crate::{Error, Result};

/// Where NVRTC is looked for. Library names newest first (the bindings are built for CUDA 13.0;
/// 12.x NVRTC also works for compiling these sources).
const SEARCH: Search = Search {
    env: "NIBBLE_NVRTC_LIB",
    names: &["libnvrtc.so.13", "libnvrtc.so.12"],
    wheel_dirs: &["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"],
    system_dirs: &["/usr/local/cuda/lib64"],
};

static LOADED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();

/// Makes NVRTC loadable, returning the library path it uses (a bare name: the loader found it).
/// Fails with a message that lists every place it looked.
pub fn load() -> Result<PathBuf> {
    LOADED
        .get_or_init(find_and_open)
        .clone()
        .map_err(Error::NvrtcNotFound)
}

fn find_and_open() -> std::result::Result<PathBuf, String> {
    SEARCH
        .find(open_file)
        .map(|(file, ())| file)
        .map_err(|tried| {
            format!(
                "NVRTC (libnvrtc.so.13 or .12) not found. Install it with \
             `pip install nvidia-cuda-nvrtc==13.0.88` (scripts/deps.sh does), or set \
             NIBBLE_NVRTC_LIB to the library or its directory. Looked in: {tried}"
            )
        })
}

/// Opens NVRTC's builtins (same directory) and then NVRTC itself, globally, and keeps them.
fn open_file(file: &Path) -> std::result::Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    if let Some(dir) = file.parent() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("libnvrtc-builtins.so") {
                    // SAFETY: as above; a failure here surfaces when NVRTC itself is used.
                    if let Ok(lib) =
                        unsafe { Library::open(Some(entry.path()), RTLD_NOW | RTLD_GLOBAL) }
                    {
                        std::mem::forget(lib);
                    }
                }
            }
        }
    }
    // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
    let lib =
        unsafe { Library::open(Some(file), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}

/// One compiled source: its name and PTX.
pub struct Compiled {
    pub name: &'static str,
    pub ptx: Ptx,
}

/// Compiles every kernel source for `arch` ("sm_90", "sm_80", ...). Needs NVRTC, not a GPU.
pub fn compile_all(arch: &'static str) -> Result<Vec<Compiled>> {
    crate::SOURCES
        .iter()
        .map(|(name, body)| compile(name, body, arch, &[]))
        .collect()
}

/// Compiles the Hopper-only source (`crate::HOPPER_SOURCE`) for sm_90a. Needs NVRTC, not a GPU.
pub fn compile_hopper() -> Result<Compiled> {
    let (name, body) = crate::HOPPER_SOURCE;
    compile(name, body, "sm_90a", &[])
}

/// Compiles one source (the prelude prepended) for `arch` with extra NVRTC options.
pub fn compile(
    name: &'static str,
    body: &str,
    arch: &'static str,
    extra: &[&str],
) -> Result<Compiled> {
    load()?;
    let src = format!("{}\n{}", crate::PRELUDE, body);
    let mut options = vec!["--std=c++17".to_string()];
    options.extend(extra.iter().map(|o| o.to_string()));
    let opts = CompileOptions {
        arch: Some(arch),
        options,
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(src, opts).map_err(|e| Error::Compile {
        source_name: name,
        arch,
        log: match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        },
    })?;
    Ok(Compiled { name, ptx })
}

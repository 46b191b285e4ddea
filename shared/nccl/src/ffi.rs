//! The dozen NCCL entry points nibble calls, opened at run time (no NCCL to build).
//!
//! Why not cudarc's `nccl` module: cudarc 0.19 opens NCCL by the names `libnccl.so` and
//! `libnccl.so.<CUDA major>` (13 here), never `libnccl.so.2`, the SONAME that the runtime package
//! and the PyPI wheel (`nvidia-nccl-cu13`) install; its `Comm` is not `Send`, unwraps errors in
//! `Drop` (a failed `ncclGroupEnd` panics) and has no non-blocking initialization, which is the
//! only way to give `ncclCommInitRank` a timeout. So this module loads the library itself, with
//! C-ABI types declared here (results as plain `int`, so a code newer than these bindings is an
//! error, not undefined behaviour), and [`super::Communicator`] wraps them.
//!
//! Where it looks, in order: `NIBBLE_NCCL_LIB` (the file or its directory); `libnccl.so.2` and
//! `libnccl.so` on the loader's search path; the PyPI wheels `nvidia/nccl/lib` under python3's
//! site-packages; `/usr/local/cuda/lib64`; `/usr/lib/x86_64-linux-gnu`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol, RTLD_GLOBAL, RTLD_NOW};

use nibble_cuda::libs::Search;

/// `ncclResult_t`.
pub(crate) type NcclResult = c_int;
pub(crate) const NCCL_SUCCESS: NcclResult = 0;
pub(crate) const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `cudaStream_t` (the same handle as the driver's `CUstream`).
pub(crate) type RawStream = *mut c_void;

/// `ncclDataType_t`'s `ncclUint8` (stable since NCCL 2.0).
pub(crate) const NCCL_UINT8: c_int = 1;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawUniqueId {
    pub internal: [c_char; 128],
}

/// `NCCL_CONFIG_UNDEF_INT`: "library default".
const UNDEF_INT: c_int = i32::MIN;
/// `NCCL_CONFIG_UNDEF_PTR`.
const UNDEF_PTR: *const c_char = std::ptr::null();

/// `ncclConfig_t` as NCCL 2.17 defined it. NCCL reads a config by its `size` and `version`
/// fields, so this prefix works with every library from 2.17 on (later fields keep their
/// defaults); declaring the newest layout would be rejected by older libraries.
#[repr(C)]
pub(crate) struct RawConfig {
    size: usize,
    magic: u32,
    version: u32,
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.17: everything at the library's default.
    pub fn new() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafebeef,
            version: 2_17_00,
            blocking: 1,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: UNDEF_PTR,
            split_share: UNDEF_INT,
        }
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueId = unsafe extern "C" fn(*mut RawUniqueId) -> NcclResult;
type InitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclResult;
type CommFn = unsafe extern "C" fn(RawComm) -> NcclResult;
type GetAsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastError = unsafe extern "C" fn(RawComm) -> *const c_char;

/// The opened library: every entry point resolved once.
pub(crate) struct Api {
    pub path: PathBuf,
    /// `ncclGetVersion`'s code, e.g. 22703 for 2.27.3.
    pub version: c_int,
    pub get_unique_id: Symbol<GetUniqueId>,
    pub init_rank_config: Symbol<InitRankConfig>,
    pub get_async_error: Symbol<GetAsyncError>,
    pub finalize: Symbol<CommFn>,
    pub destroy: Symbol<CommFn>,
    pub abort: Symbol<CommFn>,
    pub send: Symbol<SendFn>,
    pub recv: Symbol<RecvFn>,
    pub group_start: Symbol<GroupFn>,
    pub group_end: Symbol<GroupFn>,
    error_string: Symbol<ErrorString>,
    last_error: Symbol<LastError>,
    /// Kept open for the process's life (the symbols point into it).
    _lib: Library,
}

// SAFETY: the symbols are plain function pointers into a library that is never unloaded; NCCL's
// entry points may be called from any thread.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

impl Api {
    /// NCCL's name for a result code.
    pub fn error_string(&self, code: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let ptr = unsafe { (self.error_string)(code) };
        c_string(ptr).unwrap_or_else(|| format!("NCCL error {code}"))
    }

    /// NCCL's last error message (about `comm`, or the thread's last call when null).
    pub fn last_error(&self, comm: RawComm) -> Option<String> {
        // SAFETY: ncclGetLastError takes a valid or null communicator and returns a string NCCL
        // owns, valid until the next NCCL call on this thread (copied right away).
        let ptr = unsafe { (self.last_error)(comm) };
        c_string(ptr).filter(|s| !s.is_empty())
    }
}

fn c_string(ptr: *const c_char) -> Option<String> {
    // SAFETY: NCCL's strings are NUL-terminated; null is checked.
    (!ptr.is_null()).then(|| {
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    })
}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

/// The library, opened on first use; the error says everywhere it looked.
pub(crate) fn api() -> std::result::Result<&'static Api, String> {
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// Where NCCL is looked for (`nibble_cuda::libs`'s order).
const SEARCH: Search = Search {
    env: "NIBBLE_NCCL_LIB",
    names: &["libnccl.so.2", "libnccl.so"],
    wheel_dirs: &["nvidia/nccl/lib"],
    system_dirs: &["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"],
};

fn open() -> std::result::Result<Api, String> {
    // SAFETY: loading NCCL runs its initializers, which have no preconditions.
    let found = SEARCH.find(|file| {
        unsafe { Library::open(Some(file), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())
    });
    let (file, lib) = found.map_err(|tried| {
        format!(
            "NCCL (libnccl.so.2) not found: install the NCCL runtime (the CUDA image's libnccl2, \
             or `pip install nvidia-nccl-cu13`) or set NIBBLE_NCCL_LIB. Looked at: {tried}"
        )
    })?;
    resolve(lib, file)
}

fn resolve(lib: Library, path: PathBuf) -> std::result::Result<Api, String> {
    fn sym<T>(lib: &Library, name: &str) -> std::result::Result<Symbol<T>, String> {
        // SAFETY: each name is paired with its C signature in the type aliases above.
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map_err(|e| format!("NCCL lacks {name} (NCCL 2.17 or newer is needed): {e}"))
    }
    let get_version: Symbol<GetVersion> = sym(&lib, "ncclGetVersion")?;
    let mut version = 0;
    // SAFETY: writes one int.
    let code = unsafe { get_version(&mut version) };
    if code != NCCL_SUCCESS {
        return Err(format!("ncclGetVersion failed with code {code}"));
    }
    if version < 2_17_00 {
        return Err(format!(
            "NCCL {} at {} is too old: non-blocking communicators need 2.17 or newer",
            version_string(version),
            path.display()
        ));
    }
    Ok(Api {
        version,
        get_unique_id: sym(&lib, "ncclGetUniqueId")?,
        init_rank_config: sym(&lib, "ncclCommInitRankConfig")?,
        get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
        finalize: sym(&lib, "ncclCommFinalize")?,
        destroy: sym(&lib, "ncclCommDestroy")?,
        abort: sym(&lib, "ncclCommAbort")?,
        send: sym(&lib, "ncclSend")?,
        recv: sym(&lib, "ncclRecv")?,
        group_start: sym(&lib, "ncclGroupStart")?,
        group_end: sym(&lib, "ncclGroupEnd")?,
        error_string: sym(&lib, "ncclGetErrorString")?,
        last_error: sym(&lib, "ncclGetLastError")?,
        path,
        _lib: lib,
    })
}

/// `22703` → `"2.27.3"` (codes since 2.9: major·10000 + minor·100 + patch).
pub(crate) fn version_string(code: c_int) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_prefix_is_the_2_17_layout() {
        // size_t, 2 unsigned, 4 int, a pointer, 1 int: 8 + 8 + 16 + 8 + 4, padded to 48.
        assert_eq!(std::mem::size_of::<RawConfig>(), 48);
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
        let c = RawConfig::new();
        assert_eq!(c.size, 48);
        assert_eq!(c.version, 21700);
    }

    #[test]
    fn versions_print_as_dotted() {
        assert_eq!(version_string(22703), "2.27.3");
        assert_eq!(version_string(21700), "2.17.0");
    }
}

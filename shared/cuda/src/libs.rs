//! Where the CUDA libraries nibble opens at run time (NVRTC, cuBLAS, NCCL) are looked for, so
//! that neither a build nor `LD_LIBRARY_PATH` has to know. One order for all three:
//!
//! 1. the library's environment variable (`NIBBLE_NVRTC_LIB`, ...): the file, or the directory
//!    holding it; when set, nothing else is tried;
//! 2. each library name on the loader's own search path (`LD_LIBRARY_PATH`, the system cache);
//! 3. the PyPI wheels' directories under the `site-packages`/`dist-packages` of `python3`;
//! 4. the system directories (`/usr/local/cuda/lib64`, ...).

use std::path::{Path, PathBuf};
use std::process::Command;

/// How to find one library.
pub struct Search {
    /// The variable that names the file or its directory.
    pub env: &'static str,
    /// File names, preferred first.
    pub names: &'static [&'static str],
    /// Directories of the PyPI wheels, relative to a site-packages directory.
    pub wheel_dirs: &'static [&'static str],
    /// Absolute directories tried last.
    pub system_dirs: &'static [&'static str],
}

impl Search {
    /// The files to try, in order. A bare name (one path component) is for the loader's search.
    pub fn candidates(&self) -> Vec<PathBuf> {
        let in_dir =
            |dir: &Path| -> Vec<PathBuf> { self.names.iter().map(|n| dir.join(n)).collect() };
        if let Some(value) = std::env::var_os(self.env) {
            let path = PathBuf::from(value);
            return if path.is_dir() {
                in_dir(&path)
            } else {
                vec![path]
            };
        }
        let mut files: Vec<PathBuf> = self.names.iter().map(PathBuf::from).collect();
        for site in python_site_dirs() {
            for dir in self.wheel_dirs {
                files.extend(in_dir(&site.join(dir)));
            }
        }
        for dir in self.system_dirs {
            files.extend(in_dir(Path::new(dir)));
        }
        files
    }

    /// The first candidate `open` accepts, with what it returned; otherwise every place tried
    /// and why it failed, for the caller's error message.
    pub fn find<T>(
        &self,
        mut open: impl FnMut(&Path) -> Result<T, String>,
    ) -> Result<(PathBuf, T), String> {
        let mut tried = Vec::new();
        for file in self.candidates() {
            let bare = file.components().count() == 1;
            if !bare && !file.exists() {
                tried.push(format!("{} (absent)", file.display()));
                continue;
            }
            match open(&file) {
                Ok(found) => return Ok((file, found)),
                Err(e) if bare => {
                    tried.push(format!("{} on the loader search path: {e}", file.display()))
                }
                Err(e) => tried.push(format!("{}: {e}", file.display())),
            }
        }
        Err(tried.join(", "))
    }
}

/// The `site-packages` (or `dist-packages`) directories of `python3`, if it runs.
pub fn python_site_dirs() -> Vec<PathBuf> {
    let script = "import site,sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))";
    let Ok(out) = Command::new("python3").args(["-c", script]).output() else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let dir = PathBuf::from(line.trim());
        if !line.trim().is_empty() && dir.is_dir() && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_by_name_then_in_wheels_then_system_dirs() {
        let search = Search {
            env: "NIBBLE_TEST_LIBS_UNSET",
            names: &["liba.so.2", "liba.so"],
            wheel_dirs: &["nvidia/a/lib"],
            system_dirs: &["/opt/a"],
        };
        let files = search.candidates();
        assert_eq!(
            files[..2],
            [PathBuf::from("liba.so.2"), PathBuf::from("liba.so")]
        );
        assert_eq!(
            files[files.len() - 2..],
            [
                PathBuf::from("/opt/a/liba.so.2"),
                PathBuf::from("/opt/a/liba.so")
            ]
        );
        assert!(files[2..files.len() - 2]
            .iter()
            .all(|f| f.to_string_lossy().contains("nvidia/a/lib/liba.so")));
        // Absent files are skipped without opening; every refusal is reported.
        let err = search
            .find(|f| Err::<(), _>(format!("no {}", f.display())))
            .unwrap_err();
        assert!(err.contains("liba.so.2 on the loader search path: no liba.so.2"));
        assert!(err.contains("/opt/a/liba.so (absent)"));
        let (file, ()) = search.find(|_| Ok(())).unwrap();
        assert_eq!(file, PathBuf::from("liba.so.2"));
    }
}

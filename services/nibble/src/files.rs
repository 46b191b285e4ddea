//! File I/O of the CLI: whole-file reads, and outputs replaced atomically.
//!
//! An output is written to a temporary file in the destination's own directory and renamed over
//! the destination only once every byte is written and synced. On any failure the temporary file
//! is removed, so no partial output ever exists and a pre-existing output is left untouched.

use std::fs;
use std::io::Write;
use std::path::Path;

use crate::{Error, Result};

/// Reads a whole file, naming it on failure.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Replaces `path` with `bytes`, atomically: either the whole new content is there or nothing
/// changed.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let fail = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".nibble-").suffix(".tmp");
    #[cfg(unix)]
    {
        // What File::create would give (before the umask), not tempfile's private 0600.
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(fail)?;
    tmp.write_all(bytes).map_err(fail)?;
    tmp.as_file().sync_all().map_err(fail)?;
    tmp.persist(path).map_err(|e| fail(e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("readable test dir")
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    }

    #[test]
    fn creates_and_replaces() {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path().join("out.bin");
        write_atomically(&out, b"first").expect("create");
        write_atomically(&out, b"second").expect("replace");
        assert_eq!(fs::read(&out).expect("written"), b"second");
        assert_eq!(entries(dir.path()), ["out.bin"], "no temporary file left");
    }

    #[test]
    fn failure_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("temp dir");
        // The destination is a directory: the final rename fails after the data was written.
        let target = dir.path().join("taken");
        fs::create_dir(&target).expect("mkdir");
        let err = write_atomically(&target, b"data").expect_err("cannot replace a directory");
        assert!(err.to_string().starts_with("cannot write "), "{err}");
        assert!(err.to_string().contains("taken"), "{err}");
        assert_eq!(entries(dir.path()), ["taken"], "temporary file removed");
        assert!(entries(&target).is_empty());
    }

    #[test]
    fn missing_directory_is_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path().join("missing").join("out.bin");
        let err = write_atomically(&out, b"data").expect_err("no such directory");
        assert!(err.to_string().contains("missing/out.bin"), "{err}");
        assert!(!out.exists());
    }

    #[test]
    fn read_names_the_file() {
        let err = read(Path::new("/nonexistent/nibble-input.f32")).expect_err("missing");
        assert!(
            err.to_string()
                .starts_with("cannot read /nonexistent/nibble-input.f32: "),
            "{err}"
        );
    }
}

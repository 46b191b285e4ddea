//! CI gate: every kernel source compiles through NVRTC for sm_90 (and sm_80, the oldest chip the
//! kernels support) with no GPU, and its PTX assembles with `ptxas`. NVRTC or ptxas missing is a
//! failure, not a skip: CI installs both (scripts/deps.sh, PyPI `nvidia-cuda-nvrtc` and
//! `nvidia-cuda-nvcc`).

use std::path::PathBuf;
use std::process::Command;

use nibble_cuda::libs::Search;
use nibble_cuda::{nvrtc, ENTRY_POINTS, HOPPER_ENTRY_POINTS};

#[test]
fn every_kernel_compiles_for_sm_90_and_sm_80() {
    let lib = nvrtc::load().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("NVRTC: {}", lib.display());
    for arch in ["sm_90", "sm_80"] {
        let compiled = nvrtc::compile_all(arch).unwrap_or_else(|e| panic!("{e}"));
        for (source, entries) in ENTRY_POINTS {
            let ptx = compiled
                .iter()
                .find(|c| c.name == source)
                .unwrap_or_else(|| panic!("{source}.cu was not compiled"))
                .ptx
                .to_src();
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{source} for {arch}"
            );
            for entry in entries.iter() {
                assert!(
                    ptx.contains(&format!(".entry {entry}(")),
                    "{source}.cu for {arch} lacks kernel {entry}"
                );
            }
            every_entry_syncs_with_the_grid_before_it(&ptx, arch, source);
        }
    }
}

#[test]
fn the_hopper_prefill_compiles_for_sm_90a_with_warpgroup_mma() {
    nvrtc::load().unwrap_or_else(|e| panic!("{e}"));
    let ptx = nvrtc::compile_hopper()
        .unwrap_or_else(|e| panic!("{e}"))
        .ptx
        .to_src();
    assert!(ptx.contains(".target sm_90a"), "prefill_hopper for sm_90a");
    for entry in HOPPER_ENTRY_POINTS {
        assert!(
            ptx.contains(&format!(".entry {entry}(")),
            "prefill_hopper.cu lacks kernel {entry}"
        );
    }
    for op in [
        "wgmma.mma_async",
        "setmaxnreg",
        "mbarrier.try_wait",
        "cp.async",
        "cp.async.bulk.tensor.2d",
        "mbarrier.arrive.expect_tx",
    ] {
        assert!(ptx.contains(op), "prefill_hopper.cu for sm_90a has no {op}");
    }
    every_entry_syncs_with_the_grid_before_it(&ptx, "sm_90a", "prefill_hopper");
}

/// Kernels are launched programmatically on sm_90 (`launcher.rs`): one that does not wait for
/// the kernel before it could read its inputs before they are written. Every entry point of the
/// sm_90 PTX must wait (`grid_dependency_sync`); sm_80 has no such instruction.
fn every_entry_syncs_with_the_grid_before_it(ptx: &str, arch: &str, source: &str) {
    let entries: Vec<&str> = ptx.split(".entry ").skip(1).collect();
    assert!(
        !entries.is_empty(),
        "{source}.cu for {arch}: no entry points"
    );
    for body in entries {
        let name = body.split('(').next().unwrap_or(body);
        let waits = body.contains("griddepcontrol.wait;");
        if arch.starts_with("sm_90") {
            assert!(
                waits,
                "{source}.cu kernel {name} for sm_90 does not call grid_dependency_sync()"
            );
            assert!(
                body.contains("griddepcontrol.launch_dependents;"),
                "{source}.cu kernel {name} for sm_90 never lets the next kernel launch"
            );
        } else {
            assert!(
                !waits,
                "{source}.cu kernel {name} for {arch} uses griddepcontrol"
            );
        }
    }
}

#[test]
fn the_backend_ops_compile_for_sm_90_and_sm_80() {
    for arch in ["sm_90", "sm_80"] {
        let ptx = nibble_cuda::backend::compile_ops(arch)
            .unwrap_or_else(|e| panic!("{e}"))
            .ptx
            .to_src();
        for entry in nibble_cuda::backend::OPS_ENTRY_POINTS {
            assert!(
                ptx.contains(&format!(".entry {entry}(")),
                "ops.cu for {arch} lacks kernel {entry}"
            );
        }
        every_entry_syncs_with_the_grid_before_it(&ptx, arch, "ops");
    }
}

/// Where `ptxas` is: `NIBBLE_PTXAS` (the file or its directory), the `PATH`, the PyPI wheel
/// `nvidia-cuda-nvcc` under python3's site-packages, a CUDA toolkit.
fn ptxas() -> PathBuf {
    let search = Search {
        env: "NIBBLE_PTXAS",
        names: &["ptxas"],
        wheel_dirs: &["nvidia/cu13/bin"],
        system_dirs: &["/usr/local/cuda/bin"],
    };
    let runs = |file: &std::path::Path| -> Result<(), String> {
        match Command::new(file).arg("--version").output() {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!("exit status {}", out.status)),
            Err(e) => Err(e.to_string()),
        }
    };
    match search.find(runs) {
        Ok((file, ())) => file,
        Err(tried) => panic!(
            "ptxas not found (bash scripts/deps.sh installs it from PyPI nvidia-cuda-nvcc); tried: {tried}"
        ),
    }
}

/// NVRTC passes inline assembly (wgmma, mbarriers, tensor copies, the decode kernels' bit
/// tricks) into the PTX unread, so a mistyped instruction would surface only when a GPU's driver
/// assembles it at start-up. Each source's PTX is assembled here for its target, as the driver
/// will: sm_90 and sm_80 for every source and the backend's ops, sm_90a for the Hopper prefill.
#[test]
fn every_kernel_assembles_with_ptxas() {
    nvrtc::load().unwrap_or_else(|e| panic!("{e}"));
    let ptxas = ptxas();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut modules = Vec::new();
    for arch in ["sm_90", "sm_80"] {
        for compiled in nvrtc::compile_all(arch).unwrap_or_else(|e| panic!("{e}")) {
            modules.push((arch, compiled));
        }
        let ops = nibble_cuda::backend::compile_ops(arch).unwrap_or_else(|e| panic!("{e}"));
        modules.push((arch, ops));
    }
    let hopper = nvrtc::compile_hopper().unwrap_or_else(|e| panic!("{e}"));
    modules.push(("sm_90a", hopper));
    for (arch, compiled) in modules {
        let ptx = dir.path().join(format!("{}.{arch}.ptx", compiled.name));
        std::fs::write(&ptx, compiled.ptx.to_src()).expect("writing the PTX");
        let out = Command::new(&ptxas)
            .arg(format!("-arch={arch}"))
            .arg(&ptx)
            .arg("-o")
            .arg(dir.path().join(format!("{}.{arch}.cubin", compiled.name)))
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
        assert!(
            out.status.success(),
            "{}.cu for {arch} does not assemble:\n{}",
            compiled.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

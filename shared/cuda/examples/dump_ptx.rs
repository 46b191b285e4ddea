//! Writes the PTX of every kernel source (the backend's dense ops included) for one target, and
//! for sm_90 the Hopper prefill's for sm_90a, for reading or for `ptxas -v`:
//! `cargo run -p nibble-cuda --example dump_ptx -- sm_90 DIR`.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let arch: &'static str = match args.next().as_deref() {
        Some("sm_80") => "sm_80",
        Some("sm_89") => "sm_89",
        Some("sm_90") | None => "sm_90",
        Some(other) => anyhow::bail!("unknown target {other} (sm_80, sm_89, sm_90)"),
    };
    let dir = std::path::PathBuf::from(args.next().unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&dir)?;
    let ops = nibble_cuda::backend::compile_ops(arch)?;
    for compiled in nibble_cuda::nvrtc::compile_all(arch)?
        .into_iter()
        .chain([ops])
    {
        let path = dir.join(format!("{}.{arch}.ptx", compiled.name));
        std::fs::write(&path, compiled.ptx.to_src())?;
        println!("{}", path.display());
    }
    if arch == "sm_90" {
        let hopper = nibble_cuda::nvrtc::compile_hopper()?;
        let path = dir.join(format!("{}.sm_90a.ptx", hopper.name));
        std::fs::write(&path, hopper.ptx.to_src())?;
        println!("{}", path.display());
    }
    Ok(())
}

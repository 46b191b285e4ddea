//! nccl-check: the NCCL page transfer on real GPUs, every byte compared.
//!
//! On GPU 0 (needs one GPU):
//! * gather/scatter: random NVFP4 pages (Llama-3-8B geometry, `fill_random`) gathered from
//!   scattered ids into a staging buffer and scattered into other ids of a second pool; every
//!   page compared with its source, every other page checked untouched;
//! * NCCL with one rank: a non-blocking communicator sends the staging buffer to itself (one
//!   group of send + receive), the received bytes compared.
//!
//! Across GPUs 0 and 1 (needs two): rank 0 (the prefill side, GPU 0) and rank 1 (the decode side,
//! GPU 1) join one communicator from a unique id, each on its own thread; P gathers a request's
//! scattered pages (64, 256, then 1024 pages) and sends them, D receives them and scatters them
//! into different page ids; every byte of D's pool is compared (targets equal P's sources, the
//! rest zero). Reports the NCCL receive rate (GB/s: CUDA events around the receive on rank 1's
//! stream, both ranks released together before each repeat; median and best of the repeats) and
//! the end-to-end rate of a transfer with gather and scatter (host clock, slower side): with
//! staging buffers allocated and zeroed for it, and with pooled staging as workers move pages
//! (`StagingPool`, uninitialized buffers of a size class, sending and receiving only the
//! transfer's bytes): the first pooled transfer allocates, the second reuses that buffer and is
//! the one timed; the pool must allocate once per size, and D's pool is compared after the
//! pooled transfers alone wrote it.
//!
//! Exits 0 only when the two-GPU transfer ran and every check passed. With one GPU it runs the
//! single-GPU checks, says the two-GPU transfer was NOT tested, and exits 1; without a GPU, NVRTC
//! or NCCL it exits 1. Run: `cargo run --release -p nibble-cuda --example nccl_check`
//! (NCCL found on the loader path, under python3's `nvidia/nccl/lib`, or at `NIBBLE_NCCL_LIB`).

use std::process::ExitCode;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice};
use nibble_cuda::{DeviceStaging, Kernels, PageGeom};
use nibble_kvfmt::{KvDtype, PageLayout};
use nibble_nccl::staging::{Staging, StagingPool};
use nibble_nccl::{self as nccl, Communicator, UniqueId};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

/// Llama-3-8B: 32 layers, 8 KV heads of 128, 16-token pages: 589,824 NVFP4 bytes a page.
const LAYERS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const PAGE: usize = 16;
/// Pages in each pool.
const POOL_PAGES: usize = 1536;
/// Pages a request moves.
const SIZES: [usize; 3] = [64, 256, 1024];
const WARMUP: usize = 2;
const REPEATS: usize = 10;
const TIMEOUT: Duration = Duration::from_secs(60);
/// Events that record time (cudarc's default disables timing).
const TIMED: CUevent_flags = CUevent_flags::CU_EVENT_DEFAULT;

fn main() -> ExitCode {
    let mut report = Report::default();
    let outcome = run(&mut report);
    println!();
    for line in &report.tested {
        println!("tested:     {line}");
    }
    for line in &report.not_tested {
        println!("NOT tested: {line}");
    }
    match outcome {
        Ok(()) if report.not_tested.is_empty() => {
            println!("nccl-check: PASS");
            ExitCode::SUCCESS
        }
        Ok(()) => {
            println!("nccl-check: FAIL (incomplete: the two-GPU transfer was not tested)");
            ExitCode::FAILURE
        }
        Err(e) => {
            println!("nccl-check: FAIL: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Default)]
struct Report {
    tested: Vec<String>,
    not_tested: Vec<String>,
}

fn layout() -> Result<PageLayout> {
    Ok(PageLayout::new(
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        PAGE,
        KvDtype::Nvfp4,
    )?)
}

fn run(report: &mut Report) -> Result<()> {
    report.not_tested = vec![
        "gather/scatter on GPU 0".into(),
        "NCCL self send/receive on GPU 0".into(),
        "the two-GPU NCCL transfer (GPU 0 -> GPU 1)".into(),
    ];
    ensure!(
        nibble_cuda::cuda_available(),
        "no CUDA driver with a device on this machine"
    );
    let devices = CudaContext::device_count().context("counting CUDA devices")?;
    println!("{devices} CUDA device(s)");
    ensure!(devices >= 1, "no CUDA device");
    let kernels = Kernels::new(0).context("opening GPU 0")?;
    let gathered = gather_scatter(&kernels)?;
    report.not_tested.remove(0);
    report
        .tested
        .push("gather/scatter on GPU 0 (every byte)".into());
    let (version, path) = nccl::version().context("loading NCCL")?;
    println!("NCCL {version} from {}", path.display());
    nccl_self(&kernels, &gathered)?;
    report.not_tested.remove(0);
    report
        .tested
        .push("NCCL one-rank self send/receive of the staging buffer on GPU 0 (every byte)".into());
    if devices < 2 {
        println!("only {devices} GPU: the two-GPU transfer cannot run here");
        return Ok(());
    }
    two_gpus()?;
    report.not_tested.clear();
    report.tested.push(format!(
        "NCCL transfer GPU 0 -> GPU 1 of {SIZES:?} scattered NVFP4 pages (every byte)"
    ));
    Ok(())
}

/// `n` distinct page ids of the pool, in random order.
fn scattered(rng: &mut StdRng, n: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..POOL_PAGES as u32).collect();
    ids.shuffle(rng);
    ids.truncate(n);
    ids
}

/// A pool of random valid NVFP4 pages on `kernels`' device, and its host copy.
fn random_pool(kernels: &Kernels, seed: u32) -> Result<(CudaSlice<u8>, Vec<u8>)> {
    let layout = layout()?;
    let stream = kernels.stream();
    let mut pool = stream.alloc_zeros::<u8>(POOL_PAGES * layout.page_bytes())?;
    kernels.fill_random(&mut pool, PageGeom::new(&layout, 0)?, KvDtype::Nvfp4, seed)?;
    let host = stream.clone_dtoh(&pool)?;
    Ok((pool, host))
}

/// Checks that `dst` (a host pool) holds `src`'s pages `from[i]` at `to[i]` and zeros elsewhere.
fn compare_pools(src: &[u8], from: &[u32], dst: &[u8], to: &[u32], what: &str) -> Result<()> {
    let size = layout()?.page_bytes();
    fn page_of(pool: &[u8], id: u32, size: usize) -> &[u8] {
        &pool[id as usize * size..(id as usize + 1) * size]
    }
    let page = |pool, id| page_of(pool, id, size);
    for (i, (&f, &t)) in from.iter().zip(to).enumerate() {
        if page(src, f) != page(dst, t) {
            let first = page(src, f)
                .iter()
                .zip(page(dst, t))
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            bail!("{what}: page #{i} (source {f}, target {t}) differs from byte {first} on");
        }
    }
    let mut targeted = vec![false; POOL_PAGES];
    for &t in to {
        targeted[t as usize] = true;
    }
    for id in (0..POOL_PAGES as u32).filter(|id| !targeted[*id as usize]) {
        if page(dst, id).iter().any(|b| *b != 0) {
            bail!("{what}: page {id} was not a target but was written");
        }
    }
    Ok(())
}

/// A gathered request: its staging buffer, the ids it came from and goes to, the source pool.
struct Gathered {
    staging: CudaSlice<u8>,
    from: Vec<u32>,
    to: Vec<u32>,
    host: Vec<u8>,
}

/// Gathers scattered pages into a staging buffer and scatters them into other ids.
fn gather_scatter(kernels: &Kernels) -> Result<Gathered> {
    let stream = kernels.stream().clone();
    let size = layout()?.page_bytes();
    let mut rng = StdRng::seed_from_u64(7);
    let (pool, host) = random_pool(kernels, 1)?;
    let n = SIZES[0];
    let (from, to) = (scattered(&mut rng, n), scattered(&mut rng, n));
    let mut staging = stream.alloc_zeros::<u8>(n * size)?;
    kernels.gather_pages(&mut staging, &pool, &from, size)?;
    let mut other = stream.alloc_zeros::<u8>(POOL_PAGES * size)?;
    kernels.scatter_pages(&mut other, &staging, &to, size)?;
    compare_pools(
        &host,
        &from,
        &stream.clone_dtoh(&other)?,
        &to,
        "gather/scatter",
    )?;
    println!("gather/scatter: {n} scattered pages of {size} bytes, every byte equal");
    Ok(Gathered {
        staging,
        from,
        to,
        host,
    })
}

/// One rank sends the staging buffer to itself; the received bytes, scattered, must equal the
/// source pages.
fn nccl_self(kernels: &Kernels, gathered: &Gathered) -> Result<()> {
    let Gathered {
        staging,
        from,
        to,
        host,
    } = gathered;
    let stream = kernels.stream().clone();
    let size = layout()?.page_bytes();
    let id = UniqueId::new()?;
    let mut comm = Communicator::init(kernels.context(), &id, 0, 1, TIMEOUT)?;
    let mut received = comm.stream().alloc_zeros::<u8>(staging.len())?;
    comm.exchange(&[(staging, 0)], &mut [(&mut received, 0)], TIMEOUT)?;
    comm.wait(TIMEOUT)?;
    ensure!(
        stream.clone_dtoh(&received)? == stream.clone_dtoh(staging)?,
        "NCCL self send/receive: the received staging buffer differs"
    );
    let mut back = stream.alloc_zeros::<u8>(POOL_PAGES * size)?;
    kernels.scatter_pages(&mut back, &received, to, size)?;
    compare_pools(
        host,
        from,
        &stream.clone_dtoh(&back)?,
        to,
        "NCCL self send/receive",
    )?;
    println!(
        "NCCL one rank: {} MB sent to itself and scattered, every byte equal",
        staging.len() >> 20
    );
    Ok(())
}

/// Two threads meeting before each timed transfer; either side failing releases the other.
#[derive(Default)]
struct Meet {
    /// (generation, arrived, abandoned)
    state: Mutex<(u64, usize, bool)>,
    met: Condvar,
}

impl Meet {
    fn wait(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        ensure!(!s.2, "the other rank failed");
        s.1 += 1;
        if s.1 == 2 {
            s.1 = 0;
            s.0 += 1;
            self.met.notify_all();
            return Ok(());
        }
        let generation = s.0;
        let deadline = Instant::now() + TIMEOUT;
        while s.0 == generation {
            ensure!(!s.2, "the other rank failed");
            let left = deadline.saturating_duration_since(Instant::now());
            ensure!(
                !left.is_zero(),
                "the other rank did not arrive within {TIMEOUT:?}"
            );
            s = self.met.wait_timeout(s, left).unwrap().0;
        }
        Ok(())
    }

    fn abandon(&self) {
        self.state.lock().unwrap().2 = true;
        self.met.notify_all();
    }
}

/// What one side measured for one transfer size.
struct Timing {
    /// NCCL send/receive alone, each repeat.
    link: Vec<Duration>,
    /// Gather + send (P) or receive + scatter (D) through staging allocated for it.
    end_to_end: Duration,
    /// The same through a warm staging pool.
    pooled: Duration,
}

/// A pool of device staging buffers allocated on `stream`, as a worker keeps them.
fn staging_pool(stream: &Arc<cudarc::driver::CudaStream>) -> Arc<StagingPool> {
    let stream = Arc::clone(stream);
    Arc::new(StagingPool::new(
        Arc::new(move |bytes| Ok(Staging::Device(DeviceStaging::alloc(&stream, bytes)?))),
        8 << 30,
    ))
}

/// The device buffer of a pooled staging buffer.
fn device(staging: &mut Staging) -> Result<&mut DeviceStaging> {
    match staging {
        Staging::Device(d) => Ok(d),
        Staging::Host(_) => bail!("a device pool lent a host buffer"),
    }
}

fn two_gpus() -> Result<()> {
    let id = UniqueId::new()?;
    let barrier = Arc::new(Meet::default());
    let (tx_ids, rx_ids) = mpsc::channel::<(Vec<u32>, Vec<u32>)>();
    let sender = {
        let barrier = Arc::clone(&barrier);
        std::thread::spawn(move || {
            let result = prefill_side(id, &barrier, tx_ids);
            if result.is_err() {
                barrier.abandon();
            }
            result
        })
    };
    let receiver = {
        let barrier = Arc::clone(&barrier);
        std::thread::spawn(move || {
            let result = decode_side(id, &barrier, rx_ids);
            if result.is_err() {
                barrier.abandon();
            }
            result
        })
    };
    let sent = sender
        .join()
        .map_err(|_| anyhow::anyhow!("rank 0 panicked"));
    let received = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("rank 1 panicked"));
    let (p_host, p_times) = sent?.context("rank 0 (GPU 0)")?;
    let results = received?.context("rank 1 (GPU 1)")?;
    let size = layout()?.page_bytes();
    for ((n, from, to, d_host, d_time), p_time) in results.into_iter().zip(p_times) {
        compare_pools(&p_host, &from, &d_host, &to, &format!("{n}-page transfer"))?;
        let bytes = (n * size) as f64;
        let mut link = d_time.link.clone();
        link.sort();
        let median = link[link.len() / 2];
        let e2e = d_time.end_to_end.max(p_time.end_to_end);
        let pooled = d_time.pooled.max(p_time.pooled);
        println!(
            "{n} pages ({:.1} MB nvfp4): NCCL receive {:.1} GB/s (median of {REPEATS}, best \
             {:.1}), gather+send+receive+scatter {:.1} GB/s with fresh staging, {:.1} GB/s \
             with pooled staging; every byte equal",
            bytes / 1e6,
            bytes / median.as_secs_f64() / 1e9,
            bytes / link[0].as_secs_f64() / 1e9,
            bytes / e2e.as_secs_f64() / 1e9,
            bytes / pooled.as_secs_f64() / 1e9,
        );
    }
    Ok(())
}

type SenderResult = Result<(Vec<u8>, Vec<Timing>)>;

/// Rank 0 on GPU 0: random pages, gathered and sent for each size.
fn prefill_side(
    id: UniqueId,
    barrier: &Meet,
    ids: mpsc::Sender<(Vec<u32>, Vec<u32>)>,
) -> SenderResult {
    {
        let kernels = Kernels::new(0).context("opening GPU 0")?;
        let size = layout()?.page_bytes();
        let (pool, host) = random_pool(&kernels, 2)?;
        let mut comm = Communicator::init(kernels.context(), &id, 0, 2, TIMEOUT)?;
        let staging_pool = staging_pool(kernels.stream());
        let mut rng = StdRng::seed_from_u64(11);
        let mut timings = Vec::new();
        for n in SIZES {
            let (from, to) = (scattered(&mut rng, n), scattered(&mut rng, n));
            ids.send((from.clone(), to)).context("rank 1 is gone")?;
            let mut staging = kernels.stream().alloc_zeros::<u8>(n * size)?;
            let mut link = Vec::new();
            kernels.gather_pages(&mut staging, &pool, &from, size)?;
            kernels.stream().synchronize()?;
            let stream = comm.stream().clone();
            for i in 0..WARMUP + REPEATS {
                barrier.wait()?;
                let start = stream.record_event(Some(TIMED))?;
                comm.send(&staging, 1, TIMEOUT)?;
                let end = stream.record_event(Some(TIMED))?;
                comm.wait(TIMEOUT)?;
                if i >= WARMUP {
                    link.push(Duration::from_secs_f32(start.elapsed_ms(&end)? / 1e3));
                }
            }
            // The checked transfer: gather included.
            barrier.wait()?;
            let t = Instant::now();
            let mut fresh = kernels.stream().alloc_zeros::<u8>(n * size)?;
            kernels.gather_pages(&mut fresh, &pool, &from, size)?;
            comm.send(&fresh, 1, TIMEOUT)?;
            comm.wait(TIMEOUT)?;
            let end_to_end = t.elapsed();
            let allocated = staging_pool.stats().allocations;
            let mut pooled = Duration::ZERO;
            for _ in 0..2 {
                barrier.wait()?;
                let t = Instant::now();
                let mut staging = staging_pool.take(n * size)?;
                let buf = device(staging.get_mut()?)?;
                buf.set_len(n * size)?;
                kernels.gather_pages(buf.buffer_mut(), &pool, &from, size)?;
                comm.send_bytes(buf.buffer(), buf.len(), 1, TIMEOUT)?;
                comm.wait(TIMEOUT)?;
                pooled = t.elapsed();
            }
            ensure!(
                staging_pool.stats().allocations == allocated + 1,
                "rank 0: the second pooled transfer of {n} pages allocated again"
            );
            timings.push(Timing {
                link,
                end_to_end,
                pooled,
            });
        }
        Ok((host, timings))
    }
}

type ReceiverResult = Result<Vec<(usize, Vec<u32>, Vec<u32>, Vec<u8>, Timing)>>;

/// Rank 1 on GPU 1: receives each size and scatters it into other page ids.
fn decode_side(
    id: UniqueId,
    barrier: &Meet,
    ids: mpsc::Receiver<(Vec<u32>, Vec<u32>)>,
) -> ReceiverResult {
    let kernels = Kernels::new(1).context("opening GPU 1")?;
    let size = layout()?.page_bytes();
    let stream = kernels.stream().clone();
    let mut pool = stream.alloc_zeros::<u8>(POOL_PAGES * size)?;
    let mut comm = Communicator::init(kernels.context(), &id, 1, 2, TIMEOUT)?;
    let staging_pool = staging_pool(comm.stream());
    let mut results = Vec::new();
    for n in SIZES {
        let (from, to) = ids.recv().context("rank 0 failed")?;
        stream.memset_zeros(&mut pool)?;
        let mut staging = comm.stream().alloc_zeros::<u8>(n * size)?;
        let mut link = Vec::new();
        let comm_stream = comm.stream().clone();
        for i in 0..WARMUP + REPEATS {
            barrier.wait()?;
            let start = comm_stream.record_event(Some(TIMED))?;
            comm.recv(&mut staging, 0, TIMEOUT)?;
            let end = comm_stream.record_event(Some(TIMED))?;
            comm.wait(TIMEOUT)?;
            if i >= WARMUP {
                link.push(Duration::from_secs_f32(start.elapsed_ms(&end)? / 1e3));
            }
        }
        barrier.wait()?;
        let t = Instant::now();
        let mut fresh = comm.stream().alloc_zeros::<u8>(n * size)?;
        comm.recv(&mut fresh, 0, TIMEOUT)?;
        comm.wait(TIMEOUT)?;
        kernels.scatter_pages(&mut pool, &fresh, &to, size)?;
        stream.synchronize()?;
        let end_to_end = t.elapsed();
        // Only the pooled transfers write the pool that is compared.
        stream.memset_zeros(&mut pool)?;
        let allocated = staging_pool.stats().allocations;
        let mut pooled = Duration::ZERO;
        for _ in 0..2 {
            barrier.wait()?;
            let t = Instant::now();
            let mut staging = staging_pool.take(n * size)?;
            let buf = device(staging.get_mut()?)?;
            buf.set_len(n * size)?;
            comm.recv_bytes(buf.buffer_mut(), n * size, 0, TIMEOUT)?;
            comm.wait(TIMEOUT)?;
            kernels.scatter_pages(&mut pool, buf.buffer(), &to, size)?;
            stream.synchronize()?;
            pooled = t.elapsed();
        }
        ensure!(
            staging_pool.stats().allocations == allocated + 1,
            "rank 1: the second pooled transfer of {n} pages allocated again"
        );
        results.push((
            n,
            from,
            to,
            stream.clone_dtoh(&pool)?,
            Timing {
                link,
                end_to_end,
                pooled,
            },
        ));
    }
    Ok(results)
}

//! [`Communicator`]: one NCCL communicator on one device, with its own stream.
//!
//! Every communicator is *non-blocking* (`config.blocking = 0`): initialization and each
//! enqueue return at once and are then polled, so every wait has a deadline, and a peer that
//! never joins or never posts its half costs a timeout and an `ncclCommAbort`, never a hung
//! thread. A communicator that failed or timed out is *broken*: it refuses further work and is
//! aborted when dropped; a healthy one is finalized and destroyed.
//!
//! Memory: the communicator owns no buffer. [`send`](Communicator::send) and
//! [`recv`](Communicator::recv) take cudarc slices, whose event tracking orders them against
//! the streams that last wrote or read them (the caller's kernels on other streams included);
//! the completion wait ([`wait`](Communicator::wait)) is what makes reusing or freeing them safe.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::ffi::{self, Api, RawComm, RawConfig, NCCL_IN_PROGRESS, NCCL_SUCCESS, NCCL_UINT8};
use super::{api, UniqueId};
use crate::{Error, Result};

/// Longest sleep between two polls of a pending operation.
const MAX_POLL: Duration = Duration::from_micros(250);

/// A communicator of `nranks` ranks on one device (see the module header).
pub struct Communicator {
    api: &'static Api,
    comm: RawComm,
    stream: Arc<CudaStream>,
    rank: usize,
    nranks: usize,
    broken: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent, which `&mut self` on every operation guarantees (`Communicator` is not `Sync`).
unsafe impl Send for Communicator {}

impl Communicator {
    /// Joins the communicator named by `id` as `rank` of `nranks` on `ctx`'s device, on a new
    /// stream of that device. Blocks until every rank joined, at most `timeout` (then the half
    /// made communicator is aborted and [`Error::Timeout`] returned).
    pub fn init(
        ctx: &Arc<CudaContext>,
        id: &UniqueId,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::init_cancellable(ctx, id, rank, nranks, timeout, &AtomicBool::new(false))
    }

    /// [`init`](Self::init) that also gives up (aborting) as soon as `cancel` is set: the
    /// other side reported that it will not join.
    pub fn init_cancellable(
        ctx: &Arc<CudaContext>,
        id: &UniqueId,
        rank: usize,
        nranks: usize,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Self> {
        if rank >= nranks || nranks == 0 {
            return Err(Error::Unsupported(format!(
                "NCCL rank {rank} of {nranks} ranks"
            )));
        }
        let api = api()?;
        let deadline = Instant::now() + timeout;
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        let mut config = RawConfig::new();
        config.blocking = 0;
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the id is passed by value; NCCL picks
        // the device current on this thread, which `bind_to_thread` set.
        let code = unsafe {
            (api.init_rank_config)(&mut comm, nranks as i32, id.raw(), rank as i32, &mut config)
        };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            if !comm.is_null() {
                // SAFETY: a communicator NCCL returned, aborted once.
                unsafe { (api.abort)(comm) };
            }
            return Err(nccl_error(api, "ncclCommInitRankConfig", code, comm));
        }
        let mut this = Self {
            api,
            comm,
            stream,
            rank,
            nranks,
            broken: false,
        };
        this.settle("ncclCommInitRankConfig", deadline, timeout, Some(cancel))?;
        Ok(this)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The stream every operation of this communicator runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether an earlier failure or timeout broke this communicator.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Enqueues sending all of `data` to `peer`; [`wait`](Self::wait) for it to finish.
    pub fn send(&mut self, data: &CudaSlice<u8>, peer: usize, timeout: Duration) -> Result<()> {
        self.send_bytes(data, data.len(), peer, timeout)
    }

    /// Enqueues sending the first `bytes` bytes of `data` (a pooled buffer may be larger).
    pub fn send_bytes(
        &mut self,
        data: &CudaSlice<u8>,
        bytes: usize,
        peer: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.exchange_parts(&[(data, bytes, peer)], &mut [], timeout)
    }

    /// Enqueues receiving `buf.len()` bytes from `peer` into `buf`; [`wait`](Self::wait) for
    /// them to land.
    pub fn recv(&mut self, buf: &mut CudaSlice<u8>, peer: usize, timeout: Duration) -> Result<()> {
        let bytes = buf.len();
        self.recv_bytes(buf, bytes, peer, timeout)
    }

    /// Enqueues receiving `bytes` bytes into the start of `buf`.
    pub fn recv_bytes(
        &mut self,
        buf: &mut CudaSlice<u8>,
        bytes: usize,
        peer: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.exchange_parts(&[], &mut [(buf, bytes, peer)], timeout)
    }

    /// Enqueues sends and receives as one NCCL group (`ncclGroupStart`/`ncclGroupEnd`): with one
    /// rank, a send to itself and the matching receive; between two ranks, both directions at
    /// once. `timeout` bounds the enqueue only.
    pub fn exchange(
        &mut self,
        sends: &[(&CudaSlice<u8>, usize)],
        recvs: &mut [(&mut CudaSlice<u8>, usize)],
        timeout: Duration,
    ) -> Result<()> {
        let sends: Vec<_> = sends.iter().map(|&(d, p)| (d, d.len(), p)).collect();
        let mut recvs: Vec<_> = recvs
            .iter_mut()
            .map(|(b, p)| {
                let len = b.len();
                (&mut **b, len, *p)
            })
            .collect();
        self.exchange_parts(&sends, &mut recvs, timeout)
    }

    /// [`exchange`](Self::exchange) of `(buffer, bytes, peer)`: the first `bytes` of each
    /// buffer.
    fn exchange_parts(
        &mut self,
        sends: &[(&CudaSlice<u8>, usize, usize)],
        recvs: &mut [(&mut CudaSlice<u8>, usize, usize)],
        timeout: Duration,
    ) -> Result<()> {
        self.check_usable()?;
        let parts = sends.iter().map(|(b, n, p)| (b.len(), *n, *p));
        for (len, bytes, peer) in parts.chain(recvs.iter().map(|(b, n, p)| (b.len(), *n, *p))) {
            if peer >= self.nranks {
                return Err(Error::Unsupported(format!(
                    "NCCL peer {peer} of a {}-rank communicator",
                    self.nranks
                )));
            }
            if bytes > len {
                return Err(Error::Shape {
                    what: "bytes to move within the buffer",
                    expected: len,
                    actual: bytes,
                });
            }
        }
        let deadline = Instant::now() + timeout;
        self.stream.context().bind_to_thread()?;
        let (api, comm, stream) = (self.api, self.comm, self.stream.clone());
        let raw_stream = stream.cu_stream() as *mut c_void;
        // cudarc makes `stream` wait for the buffers' last writers (and, for receives, readers)
        // here, and records our use when the guards drop: after the enqueue settled below.
        let mut guards = Vec::with_capacity(sends.len() + recvs.len());
        // SAFETY: group calls are thread-local brackets; every path below closes it.
        let code = unsafe { (api.group_start)() };
        if code != NCCL_SUCCESS {
            return Err(self.fail("ncclGroupStart", code));
        }
        let mut first_error = None;
        for &(data, bytes, peer) in sends {
            let (ptr, guard) = data.device_ptr(&stream);
            guards.push(guard);
            // SAFETY: `ptr` addresses `bytes <= data.len()` device bytes that stay allocated until the
            // completion wait (the caller's contract, see the module header).
            let code = unsafe {
                (api.send)(
                    ptr as *const c_void,
                    bytes,
                    NCCL_UINT8,
                    peer as i32,
                    comm,
                    raw_stream,
                )
            };
            if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS && first_error.is_none() {
                first_error = Some(("ncclSend", code));
            }
        }
        for (buf, len, peer) in recvs.iter_mut() {
            let len = *len;
            let (ptr, guard) = buf.device_ptr_mut(&stream);
            guards.push(guard);
            // SAFETY: as for the sends; NCCL writes at most `len` bytes.
            let code = unsafe {
                (api.recv)(
                    ptr as *mut c_void,
                    len,
                    NCCL_UINT8,
                    *peer as i32,
                    comm,
                    raw_stream,
                )
            };
            if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS && first_error.is_none() {
                first_error = Some(("ncclRecv", code));
            }
        }
        // SAFETY: closes the group opened above.
        let code = unsafe { (api.group_end)() };
        if let Some((op, code)) = first_error {
            return Err(self.fail(op, code));
        }
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            return Err(self.fail("ncclGroupEnd", code));
        }
        let settled = self.settle("ncclGroupEnd", deadline, timeout, None);
        drop(guards);
        settled
    }

    /// Waits until everything enqueued on this communicator's stream has finished, at most
    /// `timeout`; a peer that never posts its half, or a communicator error, breaks the
    /// communicator (then drop it: it is aborted).
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.check_usable()?;
        let deadline = Instant::now() + timeout;
        let done = self.stream.record_event(None)?;
        let mut pause = Duration::from_micros(20);
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    self.broken = true;
                    return Err(e.into());
                }
            }
            let async_error = self.async_error();
            if async_error != NCCL_SUCCESS && async_error != NCCL_IN_PROGRESS {
                return Err(self.fail("the transfer", async_error));
            }
            if Instant::now() >= deadline {
                self.broken = true;
                return Err(Error::Timeout {
                    what: "NCCL transfer",
                    after: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    /// Aborts the communicator now (its in-flight kernels exit; the peer's operations on it
    /// fail). Dropping does the same for a broken communicator.
    pub fn abort(mut self) {
        self.broken = true;
    }

    fn check_usable(&self) -> Result<()> {
        if self.broken {
            Err(Error::Unsupported(
                "the NCCL communicator is broken (an earlier error or timeout)".into(),
            ))
        } else {
            Ok(())
        }
    }

    fn async_error(&self) -> ffi::NcclResult {
        let mut state = NCCL_SUCCESS;
        // SAFETY: a live communicator and one int to write.
        let code = unsafe { (self.api.get_async_error)(self.comm, &mut state) };
        if code != NCCL_SUCCESS {
            code
        } else {
            state
        }
    }

    /// Polls a non-blocking call until it completes, fails or `deadline` passes.
    fn settle(
        &mut self,
        op: &'static str,
        deadline: Instant,
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<()> {
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_error() {
                NCCL_SUCCESS => return Ok(()),
                NCCL_IN_PROGRESS => {}
                code => return Err(self.fail(op, code)),
            }
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                self.broken = true;
                return Err(Error::Cancelled(op));
            }
            if Instant::now() >= deadline {
                self.broken = true;
                return Err(Error::Timeout {
                    what: op,
                    after: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    fn fail(&mut self, op: &'static str, code: ffi::NcclResult) -> Error {
        self.broken = true;
        nccl_error(self.api, op, code, self.comm)
    }
}

fn nccl_error(api: &Api, op: &'static str, code: ffi::NcclResult, comm: RawComm) -> Error {
    Error::Nccl {
        op,
        code,
        message: format!(
            "{}{}",
            api.error_string(code),
            api.last_error(comm)
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ),
    }
}

/// How long a healthy communicator may take to finalize before it is aborted instead.
const FINALIZE_WAIT: Duration = Duration::from_secs(2);

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        let _ = self.stream.context().bind_to_thread();
        let api = self.api;
        if !self.broken {
            // SAFETY: a live communicator, finalized once.
            let code = unsafe { (api.finalize)(self.comm) };
            let finalized = (code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS)
                && self
                    .settle(
                        "ncclCommFinalize",
                        Instant::now() + FINALIZE_WAIT,
                        FINALIZE_WAIT,
                        None,
                    )
                    .is_ok();
            if finalized {
                // SAFETY: finalized above; destroyed once.
                unsafe { (api.destroy)(self.comm) };
                return;
            }
        }
        // SAFETY: a live communicator, aborted once (abort also frees it).
        unsafe { (api.abort)(self.comm) };
    }
}

//! The device link under an NCCL page transfer, behind a trait with an in-process twin.
//!
//! A [`LinkFactory`] makes unique ids (rank 0, the prefill worker), joins two-rank links (both
//! sides) and allocates the [`Staging`] buffers its links move ([`LinkFactory::allocator`], for a
//! [`StagingPool`](crate::staging::StagingPool)); a [`Link`] sends or receives one buffer at a
//! time, borrowing it, so that the caller gives it back to its pool afterwards. [`NcclLinks`] is
//! NCCL on the worker's GPU; [`MemoryLinks`] moves host bytes between links of one process, so
//! the whole protocol (id exchange, control messages, fallback, page accounting) runs in CI
//! without a GPU. Both block, so callers run them on blocking threads; every call has a
//! deadline, and a link that failed or timed out is broken for good (dropping it aborts NCCL).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::staging::{host_allocator, Allocate};
pub use crate::staging::{Stageable, Staging};
use crate::{Communicator, Error, Result, UniqueId};
use cudarc::driver::{CudaContext, CudaStream};
use nibble_cuda::DeviceStaging;

/// Which end of a pair a worker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rank {
    /// The prefill worker: makes the id, sends.
    Sender = 0,
    /// The decode worker: joins with the id, receives.
    Receiver = 1,
}

impl Rank {
    fn peer(self) -> usize {
        match self {
            Rank::Sender => 1,
            Rank::Receiver => 0,
        }
    }
}

/// Makes ids and joins links. Calls block (see the module header).
pub trait LinkFactory: Send + Sync {
    /// `"nccl"` or `"memory"`, for logs.
    fn name(&self) -> &'static str;
    /// A fresh id naming a new pair (called by the sender).
    fn new_id(&self) -> Result<Vec<u8>>;
    /// Joins the pair named by `id` as `rank`; returns once both ranks joined. Fails after
    /// `timeout`, or as soon as `cancel` is set.
    fn join(
        &self,
        id: &[u8],
        rank: Rank,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn Link>>;
    /// Allocates the staging buffers this factory's links move (host bytes unless overridden).
    fn allocator(&self) -> Allocate {
        host_allocator()
    }
}

/// One end of a two-rank link. Operations of one pair must be issued in the same order on both
/// ends (the transfer protocol sends one transfer of a pair at a time, in order).
pub trait Link: Send {
    /// Sends `data`'s bytes (its length) to the peer and waits until they have gone, at most
    /// `timeout`. When it returns, the link no longer uses `data` (it finished, or failed and
    /// was aborted), so `data` may be reused or freed.
    fn send(&mut self, data: &Staging, timeout: Duration) -> Result<()>;
    /// Receives exactly `bytes` bytes from the peer into `into` (its capacity holds them; its
    /// length becomes `bytes`), at most `timeout`. As for `send`, the link no longer uses `into`
    /// when it returns.
    fn recv(&mut self, into: &mut Staging, bytes: usize, timeout: Duration) -> Result<()>;
}

/// NCCL on one GPU: the worker's CUDA context, and a stream staging buffers are allocated on.
pub struct NcclLinks {
    ctx: Arc<CudaContext>,
    staging: Arc<CudaStream>,
}

impl NcclLinks {
    /// NCCL links on `ctx`'s device; fails when NCCL does not load.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        crate::version()?;
        ctx.bind_to_thread()?;
        let staging = ctx.new_stream()?;
        Ok(Self { ctx, staging })
    }

    /// The UUID of the device, as NCCL endpoints advertise it.
    pub fn gpu_uuid(&self) -> Result<String> {
        let uuid = self.ctx.uuid()?;
        let hex: String = uuid
            .bytes
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect();
        Ok(format!("GPU-{hex}"))
    }
}

impl LinkFactory for NcclLinks {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn new_id(&self) -> Result<Vec<u8>> {
        Ok(UniqueId::new()?.as_bytes().to_vec())
    }

    fn join(
        &self,
        id: &[u8],
        rank: Rank,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn Link>> {
        let id = UniqueId::from_bytes(id)?;
        let comm =
            Communicator::init_cancellable(&self.ctx, &id, rank as usize, 2, timeout, cancel)?;
        Ok(Box::new(NcclLink {
            comm: Some(comm),
            peer: rank.peer(),
        }))
    }

    /// Device buffers, uninitialized (every transfer writes its bytes before they are read);
    /// cudarc's event tracking orders each reuse after the last one, on whatever stream.
    fn allocator(&self) -> Allocate {
        let stream = Arc::clone(&self.staging);
        Arc::new(move |bytes| {
            stream.context().bind_to_thread()?;
            Ok(Staging::Device(DeviceStaging::alloc(&stream, bytes)?))
        })
    }
}

/// One NCCL communicator; `None` once broken (it was aborted then).
struct NcclLink {
    comm: Option<Communicator>,
    peer: usize,
}

impl NcclLink {
    fn comm(&mut self) -> Result<&mut Communicator> {
        self.comm
            .as_mut()
            .ok_or_else(|| Error::Link("the NCCL communicator was aborted after an error".into()))
    }

    /// Runs `op`; on failure aborts the communicator (before the caller's buffers drop).
    fn guarded<T>(&mut self, op: impl FnOnce(&mut Communicator) -> Result<T>) -> Result<T> {
        let result = op(self.comm()?);
        if result.is_err() {
            drop(self.comm.take());
        }
        result
    }
}

impl Link for NcclLink {
    fn send(&mut self, data: &Staging, timeout: Duration) -> Result<()> {
        let Staging::Device(buf) = data else {
            return Err(Error::Link(
                "NCCL sends device memory, got host bytes".into(),
            ));
        };
        let peer = self.peer;
        self.guarded(|comm| {
            comm.send_bytes(buf.buffer(), buf.len(), peer, timeout)?;
            comm.wait(timeout)?;
            Ok(())
        })
        // On failure the communicator was aborted before returning: NCCL no longer reads `data`.
    }

    fn recv(&mut self, into: &mut Staging, bytes: usize, timeout: Duration) -> Result<()> {
        let Staging::Device(buf) = into else {
            return Err(Error::Link(
                "NCCL receives into device memory, got a host buffer".into(),
            ));
        };
        buf.set_len(bytes)?;
        let peer = self.peer;
        // On failure the communicator is aborted before returning: NCCL no longer writes `buf`.
        self.guarded(|comm| {
            comm.recv_bytes(buf.buffer_mut(), bytes, peer, timeout)?;
            comm.wait(timeout)
        })
    }
}

/// The in-process twin of [`NcclLinks`]: links of one hub meet by id and move host bytes.
/// Two factories made by [`MemoryLinks::new`] are separate hubs, so a worker on one never meets a
/// worker on the other (a peer that never joins).
#[derive(Clone, Default)]
pub struct MemoryLinks {
    hub: Arc<Hub>,
}

#[derive(Default)]
struct Hub {
    next: AtomicU64,
    waiting: Mutex<HashMap<Vec<u8>, Meeting>>,
    met: Condvar,
}

/// A pair being formed: the receiver's channel ends, taken by whoever joins second.
#[derive(Default)]
struct Meeting {
    joined: [bool; 2],
    ends: [Option<MemoryLink>; 2],
}

impl MemoryLinks {
    /// A new hub.
    pub fn new() -> Self {
        Self::default()
    }
}

/// [`MemoryLinks`] whose links pass through `wrap` as they are joined (with the joining rank):
/// how tests put a link that fails, stalls or records in the path of the real transfer code.
pub struct WrappedLinks<F> {
    hub: MemoryLinks,
    name: &'static str,
    wrap: F,
}

impl MemoryLinks {
    /// These links, each wrapped by `wrap` when joined; `name` is the factory's.
    pub fn wrapped<F>(&self, name: &'static str, wrap: F) -> WrappedLinks<F>
    where
        F: Fn(Box<dyn Link>, Rank) -> Box<dyn Link> + Send + Sync,
    {
        WrappedLinks {
            hub: self.clone(),
            name,
            wrap,
        }
    }
}

impl<F> LinkFactory for WrappedLinks<F>
where
    F: Fn(Box<dyn Link>, Rank) -> Box<dyn Link> + Send + Sync,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn new_id(&self) -> Result<Vec<u8>> {
        self.hub.new_id()
    }

    fn join(
        &self,
        id: &[u8],
        rank: Rank,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn Link>> {
        Ok((self.wrap)(self.hub.join(id, rank, timeout, cancel)?, rank))
    }
}

impl LinkFactory for MemoryLinks {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn new_id(&self) -> Result<Vec<u8>> {
        let n = self.hub.next.fetch_add(1, Ordering::Relaxed);
        let hub = Arc::as_ptr(&self.hub) as usize as u64;
        let mut id = vec![0u8; UniqueId::LEN];
        id[..8].copy_from_slice(&hub.to_le_bytes());
        id[8..16].copy_from_slice(&n.to_le_bytes());
        Ok(id)
    }

    fn join(
        &self,
        id: &[u8],
        rank: Rank,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Result<Box<dyn Link>> {
        let deadline = Instant::now() + timeout;
        let me = rank as usize;
        let mut waiting = self.hub.waiting.lock().unwrap_or_else(|e| e.into_inner());
        {
            let meeting = waiting.entry(id.to_vec()).or_default();
            if meeting.joined[me] {
                return Err(Error::Link(format!("rank {me} joined this pair twice")));
            }
            meeting.joined[me] = true;
            if meeting.joined == [true, true] {
                let (a, b) = MemoryLink::pair();
                meeting.ends = [Some(a), Some(b)];
                self.hub.met.notify_all();
            }
        }
        loop {
            let meeting = waiting
                .get_mut(id)
                .expect("present until both took their end");
            if let Some(end) = meeting.ends[me].take() {
                if meeting.ends.iter().all(Option::is_none) {
                    waiting.remove(id);
                }
                return Ok(Box::new(end));
            }
            let now = Instant::now();
            if now >= deadline || cancel.load(Ordering::Relaxed) {
                meeting.joined[me] = false;
                if meeting.joined == [false, false] {
                    waiting.remove(id);
                }
                return Err(Error::Link(format!(
                    "the peer did not join within {timeout:?}"
                )));
            }
            let wait = (deadline - now).min(Duration::from_millis(20));
            waiting = self
                .hub
                .met
                .wait_timeout(waiting, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One end of a memory link: bytes go out on `tx`, come in on `rx`.
struct MemoryLink {
    tx: mpsc::Sender<Vec<u8>>,
    rx: mpsc::Receiver<Vec<u8>>,
    broken: bool,
}

impl MemoryLink {
    fn pair() -> (Self, Self) {
        let (a_tx, b_rx) = mpsc::channel();
        let (b_tx, a_rx) = mpsc::channel();
        let end = |tx, rx| Self {
            tx,
            rx,
            broken: false,
        };
        (end(a_tx, a_rx), end(b_tx, b_rx))
    }

    fn check(&self) -> Result<()> {
        if self.broken {
            Err(Error::Link("the link broke after an earlier error".into()))
        } else {
            Ok(())
        }
    }
}

impl Link for MemoryLink {
    fn send(&mut self, data: &Staging, _timeout: Duration) -> Result<()> {
        self.check()?;
        let Staging::Host(bytes) = data else {
            return Err(Error::Link("memory links carry host bytes".into()));
        };
        // The channel carries a copy (the twin's wire); the caller keeps its buffer.
        if self.tx.send(bytes.clone()).is_err() {
            self.broken = true;
            return Err(Error::Link("the peer's end is gone".into()));
        }
        Ok(())
    }

    fn recv(&mut self, into: &mut Staging, bytes: usize, timeout: Duration) -> Result<()> {
        self.check()?;
        let Staging::Host(buf) = into else {
            return Err(Error::Link("memory links carry host bytes".into()));
        };
        match self.rx.recv_timeout(timeout) {
            Ok(data) if data.len() == bytes => {
                buf.clear();
                buf.extend_from_slice(&data);
                Ok(())
            }
            Ok(data) => {
                self.broken = true;
                Err(Error::Link(format!(
                    "expected {bytes} bytes, the peer sent {}",
                    data.len()
                )))
            }
            Err(e) => {
                self.broken = true;
                Err(Error::Link(format!("nothing received: {e}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_links_meet_by_id_and_move_bytes() {
        let hub = MemoryLinks::new();
        let id = hub.new_id().unwrap();
        assert_eq!(id.len(), UniqueId::LEN);
        assert_ne!(id, hub.new_id().unwrap(), "ids are fresh");
        let never = AtomicBool::new(false);
        let receiver = {
            let (hub, id) = (hub.clone(), id.clone());
            std::thread::spawn(move || {
                let cancel = AtomicBool::new(false);
                let mut link = hub
                    .join(&id, Rank::Receiver, Duration::from_secs(5), &cancel)
                    .unwrap();
                let mut into = Staging::Host(Vec::with_capacity(3));
                link.recv(&mut into, 3, Duration::from_secs(5)).unwrap();
                match into {
                    Staging::Host(b) => b,
                    Staging::Device(_) => unreachable!(),
                }
            })
        };
        let mut sender = hub
            .join(&id, Rank::Sender, Duration::from_secs(5), &never)
            .unwrap();
        sender
            .send(&Staging::Host(vec![1, 2, 3]), Duration::from_secs(1))
            .unwrap();
        assert_eq!(receiver.join().unwrap(), vec![1, 2, 3]);
        assert!(
            hub.hub.waiting.lock().unwrap().is_empty(),
            "the meeting is cleaned up"
        );
    }

    #[test]
    fn a_peer_on_another_hub_never_joins() {
        let (a, b) = (MemoryLinks::new(), MemoryLinks::new());
        let id = a.new_id().unwrap();
        let never = AtomicBool::new(false);
        let started = Instant::now();
        let err = b
            .join(&id, Rank::Receiver, Duration::from_millis(100), &never)
            .err()
            .expect("nobody joins");
        assert!(err.to_string().contains("did not join"), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(
            b.hub.waiting.lock().unwrap().is_empty(),
            "a timed-out join leaves nothing"
        );
        let cancel = AtomicBool::new(true);
        let started = Instant::now();
        assert!(a
            .join(&id, Rank::Sender, Duration::from_secs(30), &cancel)
            .is_err());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "cancel ends the wait"
        );
    }
}

//! What the worker's test binaries share: an engine over the test model and a worker served on
//! loopback, driven through [`nibble_testkit::WorkerApi`] (the model, the hand-off and the waits
//! are the testkit's).

use std::sync::Arc;
use std::time::Duration;

use nibble_engine::scheduler::SchedulerConfig;
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{engine_config, model, WorkerApi};
use nibble_worker::{EngineHandle, WorkerIdentity, WorkerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Pages in the pool of an [`engine`].
#[allow(dead_code)] // tests/metrics.rs loads its own model
pub const PAGES: usize = 64;

/// An engine over the test model with a pool of [`PAGES`] pages of `dtype`.
#[allow(dead_code)] // tests/metrics.rs loads its own model
pub fn engine(dtype: KvDtype) -> EngineHandle {
    let (model, tokenizer) = model();
    let config = engine_config(dtype, PAGES, SchedulerConfig::default());
    EngineHandle::spawn(model.clone(), Arc::clone(tokenizer), config).unwrap()
}

/// A worker served on 127.0.0.1:0 until dropped.
pub struct Server {
    pub address: String,
    pub state: Arc<WorkerState>,
    _stop: oneshot::Sender<()>,
}

impl Server {
    /// Serves `engine` as a worker of `role` named `worker_id`.
    pub async fn start(engine: EngineHandle, role: v1::WorkerRole, worker_id: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let state = WorkerState::new(
            engine,
            WorkerIdentity {
                worker_id,
                role,
                model: "smollm2".into(),
                transfer_address: if role == v1::WorkerRole::Decode {
                    address.clone()
                } else {
                    String::new()
                },
                reservation_ttl: Duration::from_secs(30),
            },
        );
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(nibble_worker::serve(
            Arc::clone(&state),
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            address,
            state,
            _stop: stop,
        }
    }
}

impl WorkerApi for Server {
    fn address(&self) -> &str {
        &self.address
    }

    fn worker_id(&self) -> String {
        self.state.identity().worker_id.clone()
    }

    fn fingerprint(&self) -> u64 {
        self.state.engine().info().fingerprint
    }
}

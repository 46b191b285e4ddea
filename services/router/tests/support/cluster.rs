//! A prefill worker, a decode worker and a router that sends every prompt through both: the
//! cluster of the HTTP API's tests (`http.rs`, `structured.rs`), which include this file.

use std::time::Duration;

use nibble_discovery::{Role, StaticRegistry};
use nibble_kvfmt::KvDtype;
use nibble_router::HttpConfig;
use nibble_testkit::{wait, RouterApi, WorkerApi};

use crate::support::{RouterServer, Worker};

/// A prefill and a decode worker and a router tracking both.
pub struct Cluster {
    pub prefill: Worker,
    pub decode: Worker,
    pub router: RouterServer,
    _registry: StaticRegistry,
}

impl Cluster {
    pub async fn start(http: HttpConfig) -> Self {
        let registry = StaticRegistry::new();
        let dtype = KvDtype::Nvfp4;
        let prefill = Worker::start(&registry, Role::Prefill, "p0", dtype).await;
        let decode = Worker::start(&registry, Role::Decode, "d0", dtype).await;
        let page_size = prefill.state.engine().info().page_size as u32;
        let router = RouterServer::start(&registry, page_size, http, |_| {}).await;
        router.wait_for_workers(1, 1).await;
        Self {
            prefill,
            decode,
            router,
            _registry: registry,
        }
    }

    pub fn http(&self) -> &str {
        self.router.http_address()
    }

    pub async fn pages_back(&self) {
        self.prefill.pages_back().await;
        self.decode.pages_back().await;
        wait::until(
            Duration::from_secs(5),
            Duration::from_millis(25),
            || async {
                match self.router.shared.router().stats().in_flight {
                    0 => Ok(()),
                    _ => Err(()),
                }
            },
        )
        .await
        .unwrap_or_else(|()| panic!("the router still counts a request"));
    }
}

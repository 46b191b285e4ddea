//! The session's keep-alive task, and re-registration when the lease is lost.
//!
//! The task renews the lease every third of its TTL over one keep-alive stream. A broken stream
//! (etcd restarting, a network blip) is reopened after the retry interval with the same lease.
//! When etcd answers that the lease is gone, a new lease is granted and every key the session
//! owns is written again under it.

use std::sync::Arc;
use std::time::Duration;

use super::Inner;
use crate::{Error, OutageLog, Result};

/// Why one keep-alive stream ended.
enum Ended {
    /// etcd no longer knows the lease.
    Lost,
    /// The stream broke; the lease may still be alive.
    Broken(Error),
}

/// Keeps the session's lease alive until the session closes (or the task is aborted).
pub(super) async fn keep_alive(inner: Arc<Inner>) {
    let interval = (inner.config.lease_ttl / 3).max(Duration::from_millis(100));
    while !inner.is_closing() {
        let lease = inner.session.lock().await.lease;
        match run_stream(&inner, lease, interval).await {
            Ended::Lost => {
                tracing::warn!(
                    lease,
                    "etcd lease lost; registering again under a new lease"
                );
                let mut outage = OutageLog::new("renewing the etcd session");
                while !inner.is_closing() {
                    match renew(&inner).await {
                        Ok(()) => {
                            outage.recover();
                            break;
                        }
                        Err(err) => {
                            outage.fail(&err);
                            tokio::time::sleep(inner.config.retry_interval).await;
                        }
                    }
                }
            }
            Ended::Broken(err) => {
                tracing::debug!(%err, lease, "etcd keep-alive stream broke; reopening");
                tokio::time::sleep(inner.config.retry_interval).await;
            }
        }
    }
}

/// Runs one keep-alive stream until it ends.
async fn run_stream(inner: &Inner, lease: i64, interval: Duration) -> Ended {
    let mut client = inner.client.clone();
    let (mut keeper, mut stream) = match inner
        .call("lease keep-alive", client.lease_keep_alive(lease))
        .await
    {
        Ok(pair) => pair,
        Err(err) => return classify(err),
    };
    loop {
        if let Err(source) = keeper.keep_alive().await {
            return classify(Error::Etcd {
                op: "lease keep-alive",
                source,
            });
        }
        match tokio::time::timeout(inner.config.request_timeout, stream.message()).await {
            Ok(Ok(Some(response))) if response.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return Ended::Lost,
            Ok(Ok(None)) => {
                return Ended::Broken(Error::EtcdTimeout {
                    op: "lease keep-alive (stream ended)",
                    after: Duration::ZERO,
                })
            }
            Ok(Err(source)) => {
                return classify(Error::Etcd {
                    op: "lease keep-alive",
                    source,
                })
            }
            Err(_) => {
                return Ended::Broken(Error::EtcdTimeout {
                    op: "lease keep-alive",
                    after: inner.config.request_timeout,
                })
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// etcd reports an unknown lease either as a zero TTL or as this error.
fn classify(err: Error) -> Ended {
    if err.to_string().contains("lease not found") {
        Ended::Lost
    } else {
        Ended::Broken(err)
    }
}

/// Grants a new lease and writes every owned key under it.
async fn renew(inner: &Inner) -> Result<()> {
    let mut session = inner.session.lock().await;
    if inner.is_closing() {
        return Ok(());
    }
    let lease = inner.grant().await?;
    session.lease = lease;
    for (key, owned) in &session.owned {
        inner.put(key, owned.bytes(), lease).await?;
    }
    tracing::info!(lease, keys = session.owned.len(), "etcd session renewed");
    Ok(())
}

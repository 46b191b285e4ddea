//! Failover of a dispatched request whose decode worker fails.
//!
//! Before any token was sent, a decode worker that cannot be reached is left for another
//! (at most [`DECODE_ATTEMPTS`] in all). After tokens were sent, the request is *resumed* on
//! another decode worker: the prompt is computed again there (through a prefill worker or
//! locally, as routing decides) and then the tokens sent, replayed through the decode path
//! (`DecodeRequest.generated_token_ids`), and the client's stream goes on with the tokens that
//! follow, under greedy decoding exactly those of an undisturbed run, with no error. A request
//! is resumed at most `--max-resumes` times ([`ServiceConfig::max_resumes`](super::super::ServiceConfig));
//! the next break ends its stream with [`Stop::Exhausted`]'s error. Either way the failed worker
//! is marked unreachable (no request goes there until it answers a load poll again), the request
//! is aborted there (best effort: what a dead worker held died with it) and routed anew without
//! it.

use std::sync::Arc;

use nibble_discovery::Role;
use nibble_proto::v1;
use tokio::sync::mpsc;
use tonic::Status;

use super::{Flow, Stop};
use crate::metrics::{self, Resume};
use crate::WorkerSet;

/// Decode workers tried per request while none has sent a token.
const DECODE_ATTEMPTS: usize = 3;

/// What becomes of a request whose decode attempt ended with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// It fails with that status (a worker's own refusal, or no attempt left before a token).
    Fail,
    /// Nothing was sent yet: it moves to another decode worker.
    Retry,
    /// Tokens were sent: it is resumed on another decode worker after them.
    Resume,
    /// Tokens were sent, and it was resumed as many times as allowed: it fails saying so.
    Exhausted,
}

/// The policy: after `status`, with a chunk `sent` or not, `retries` moves before any token and
/// `resumes` resumptions so far, at most `max_resumes`.
fn next(status: &Status, sent: bool, retries: usize, resumes: u32, max_resumes: u32) -> Next {
    match sent {
        _ if !unreachable(status) => Next::Fail,
        false if retries + 1 >= DECODE_ATTEMPTS => Next::Fail,
        false => Next::Retry,
        true if resumes >= max_resumes => Next::Exhausted,
        true => Next::Resume,
    }
}

impl Flow {
    /// [`drive`](Self::drive), moved to another decode worker when the chosen one cannot be
    /// reached before any token was sent, and resumed on another when it fails mid-stream.
    pub(super) async fn drive_with_failover(
        &mut self,
        tx: &mpsc::Sender<Result<v1::GenerateResponse, Status>>,
        prefill_address: &mut Option<String>,
    ) -> Result<(), Stop> {
        let mut failed = WorkerSet::EMPTY;
        let mut retries = 0;
        loop {
            let status = match self.drive(tx, prefill_address).await {
                Err(Stop::Failed(status)) => status,
                other => return other,
            };
            let decode = &self.routed.decision.decode;
            let (slot, worker) = (decode.slot, Arc::clone(&decode.worker));
            let max_resumes = self.shared.config().max_resumes;
            match next(&status, self.sent, retries, self.resumes, max_resumes) {
                Next::Fail => return Err(Stop::Failed(status)),
                Next::Exhausted => {
                    metrics::resume(Resume::Exhausted);
                    return Err(Stop::Exhausted(status));
                }
                Next::Retry => {
                    retries += 1;
                    tracing::warn!(worker = %worker.id, %status, "decode worker unreachable; routing elsewhere");
                    metrics::count(metrics::DECODE_RETRIES_TOTAL, 1);
                }
                Next::Resume => {
                    self.resumes += 1;
                    tracing::warn!(
                        worker = %worker.id,
                        %status,
                        streamed = self.streamed.len(),
                        resume = self.resumes,
                        "decode worker failed mid-stream; resuming elsewhere"
                    );
                    metrics::resume(Resume::Started);
                }
            }
            failed.insert(slot);
            // Free whatever a prefill worker may still hold (it may take the next attempt, so
            // this is waited for) and whatever the failed worker may, if it is there at all: in
            // the background, so that one that cannot be reached (a cut network) does not hold
            // the next attempt up for the abort's timeout.
            self.abort_on(prefill_address.take().into_iter()).await;
            let (shared, id) = (Arc::clone(&self.shared), self.req.request_id.clone());
            let address = worker.addresses.grpc.clone();
            tokio::spawn(async move { super::abort(&shared, &id, &address).await });
            let mut router = self.shared.router();
            router.set_reachable(Role::Decode, &worker.id, false);
            router.finish(self.routed.ticket);
            match router.route(&self.prompt, failed) {
                Ok(routed) => self.routed = routed,
                Err(e) => {
                    // Nothing left to take it: the ticket is gone, keep `finish` a no-op.
                    return Err(Stop::Failed(Status::unavailable(format!(
                        "decode worker {} is unreachable ({status}) and {e}",
                        worker.id
                    ))));
                }
            }
        }
    }
}

/// Whether a decode worker's failure means it could not be reached (a refused or broken
/// connection, a worker stopping), not that it refused the request. A connection that breaks
/// under a call (the worker's process died) can surface as INTERNAL from the local HTTP/2 stack:
/// such a status carries its transport error as its source, which a worker's own INTERNAL
/// answer, decoded from the wire, never does.
pub(super) fn unreachable(status: &Status) -> bool {
    use std::error::Error as _;
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => true,
        tonic::Code::Internal => status.source().is_some(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{next, unreachable, Next};
    use tonic::Status;

    #[test]
    fn a_broken_connection_is_unreachable_and_a_workers_internal_error_is_not() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let mut broken = tonic::Status::internal("h2 protocol error: connection reset");
        broken.set_source(std::sync::Arc::new(io));
        assert!(unreachable(&broken));
        assert!(!unreachable(&tonic::Status::internal("the engine failed")));
        assert!(unreachable(&tonic::Status::unavailable(
            "tcp connect error"
        )));
        assert!(!unreachable(&tonic::Status::invalid_argument("bad")));
    }

    #[test]
    fn a_broken_worker_is_left_before_a_token_and_resumed_after_until_the_limit() {
        let gone = Status::unavailable("tcp connect error");
        // Before any token: moved twice, the third failure fails the request.
        assert_eq!(next(&gone, false, 0, 0, 2), Next::Retry);
        assert_eq!(next(&gone, false, 1, 0, 2), Next::Retry);
        assert_eq!(next(&gone, false, 2, 0, 2), Next::Fail);
        // After tokens: resumed up to --max-resumes times, whatever the moves before.
        assert_eq!(next(&gone, true, 2, 0, 2), Next::Resume);
        assert_eq!(next(&gone, true, 0, 1, 2), Next::Resume);
        assert_eq!(next(&gone, true, 0, 2, 2), Next::Exhausted);
        assert_eq!(
            next(&gone, true, 0, 0, 0),
            Next::Exhausted,
            "--max-resumes 0"
        );
        // A worker's own refusal or failure is the request's answer, before or after tokens.
        for answer in [
            Status::invalid_argument("bad"),
            Status::internal("the output's constraint failed"),
        ] {
            assert_eq!(next(&answer, false, 0, 0, 2), Next::Fail);
            assert_eq!(next(&answer, true, 0, 0, 2), Next::Fail);
        }
    }
}

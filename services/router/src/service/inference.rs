//! [`InferenceService`]: the public gRPC API. A `Generate` is validated (off the async
//! threads), admitted, routed and dispatched as a [`Flow`] on its own task.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use nibble_proto::request::invalid_field;
use nibble_proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::flow::Flow;
use super::state::MintedId;
use super::validate::{self, ValidRequest};
use super::Shared;
use crate::metrics::{self, Outcome};
use crate::{Prompt, WorkerSet};

/// Longest request id a client may give (it labels the responses and log lines).
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// The `Inference` service.
#[derive(Debug, Clone)]
pub struct InferenceService(pub Arc<Shared>);

/// A request's response stream.
pub type GenerateStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

impl InferenceService {
    /// Validates `req` on a blocking thread (tokenization and chat rendering are CPU work).
    pub async fn validate(&self, req: v1::GenerateRequest) -> Result<ValidRequest, Status> {
        let shared = Arc::clone(&self.0);
        tokio::task::spawn_blocking(move || validate::validate(req, shared.config()))
            .await
            .map_err(|e| Status::internal(format!("validation task: {e}")))?
    }

    /// Validates, admits and routes `req` (in its `request` span), then dispatches it on its
    /// own task and returns its response stream. An error refuses the request.
    async fn start(
        &self,
        req: v1::GenerateRequest,
        label: Option<String>,
        arrived: Instant,
    ) -> Result<GenerateStream, Status> {
        let ValidRequest { req, tokens, .. } = self.validate(req).await?;
        let mut prompt = Prompt::new(&tokens, self.0.config().router.page_size)?;
        if (req.logprobs.as_ref()).is_some_and(|l| l.prompt_logprobs.is_some()) {
            prompt = prompt.scored();
        }
        let model = self.0.config().served_model();
        metrics::model_duration(
            metrics::PREPROCESS_DURATION_SECONDS,
            model,
            arrived.elapsed(),
        );
        let queued = Instant::now();
        let place = self.0.admission().admit().await?;
        metrics::model_duration(metrics::QUEUE_WAIT_SECONDS, model, queued.elapsed());
        let routed = {
            let mut router = self.0.router();
            let deciding = Instant::now();
            let routed = router.route(&prompt, WorkerSet::EMPTY)?;
            let decision = &routed.decision;
            metrics::decision(
                model,
                decision.reason,
                deciding.elapsed(),
                decision.prompt_tokens,
                decision.decode.cached_tokens,
            );
            routed
        };
        tracing::debug!(
            ticket = %routed.ticket,
            decode = %routed.decision.decode.worker.id,
            prefill = ?routed.decision.prefill.as_ref().map(|p| p.worker.id.to_string()),
            reason = %routed.decision.reason,
            prompt_tokens = tokens.len(),
            "routed"
        );
        let (tx, rx) = mpsc::channel(16);
        let flow = Flow::new(
            Arc::clone(&self.0),
            req,
            tokens,
            prompt,
            routed,
            place,
            arrived,
        )
        .labelled(label);
        tokio::spawn(flow.run(tx).in_current_span());
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl v1::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let arrived = Instant::now();
        let minted = request.extensions().get::<MintedId>().cloned();
        let mut req = request.into_inner();
        // The id that names the request on the workers is always this router's; a client's
        // own id only labels its responses and this router's log lines.
        let given = std::mem::take(&mut req.request_id);
        let (id, label) = match minted {
            // The HTTP API's call, under the id it minted.
            Some(id) if id.as_str() == given => (given, None),
            _ if given.len() > MAX_REQUEST_ID_BYTES => {
                return Err(invalid_field(
                    "request_id",
                    format!("is {} bytes, at most {MAX_REQUEST_ID_BYTES}", given.len()),
                ))
            }
            _ => (
                self.0.mint_request_id("router").to_string(),
                (!given.is_empty()).then_some(given),
            ),
        };
        req.request_id = id;
        // Every log line about the request, here and on its workers, carries its id; the
        // client's label is logged escaped (Debug), as it is untrusted text.
        let span = tracing::info_span!(
            "request",
            request_id = %req.request_id,
            client_request_id = tracing::field::Empty
        );
        if let Some(label) = &label {
            span.record("client_request_id", tracing::field::debug(label));
        }
        // A client that goes away while its request waits for a place drops this future.
        let model = self.0.config().served_model().to_string();
        let mut unanswered = Unanswered(Some(span.clone()), model);
        let started = self
            .start(req, label, arrived)
            .instrument(span.clone())
            .await;
        unanswered.0 = None;
        match started {
            // The flow counts it from here.
            Ok(stream) => Ok(Response::new(stream)),
            Err(status) => {
                metrics::request(&unanswered.1, Outcome::Refused, status.code());
                span.in_scope(|| tracing::info!(%status, "refused"));
                Err(status)
            }
        }
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        let req = request.into_inner();
        let config = self.0.config();
        validate::check_model(&req.model, config.served_model())?;
        validate::check_prompt_bytes(req.text.len(), config)?;
        let shared = Arc::clone(&self.0);
        let tokenize = move || -> Result<v1::TokenizeResponse, Status> {
            let tokenizer = &shared.config().tokenizer;
            let token_ids = tokenizer
                .encode(&req.text, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| Status::internal(format!("tokenizer: {e}")))?;
            let tokens = token_ids
                .iter()
                .map(|&id| tokenizer.inner().id_to_token(id).unwrap_or_default())
                .collect();
            Ok(v1::TokenizeResponse { token_ids, tokens })
        };
        let response = tokio::task::spawn_blocking(tokenize)
            .await
            .map_err(|e| Status::internal(format!("tokenize task: {e}")))??;
        Ok(Response::new(response))
    }

    async fn list_models(
        &self,
        _request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        let stats = self.0.router().stats();
        Ok(Response::new(v1::ListModelsResponse {
            models: vec![v1::ModelInfo {
                name: self.0.config().served_model().to_string(),
                max_context: self.0.config().max_context,
                kv_format: None,
                prefill_workers: stats.prefill_workers as u32,
                decode_workers: stats.decode_workers as u32,
                is_default: true,
            }],
        }))
    }
}

/// Counts a request as cancelled if dropped while it holds the request's span: its client left
/// before it was dispatched.
/// The second field is the served model's name (the metric's label).
struct Unanswered(Option<tracing::Span>, String);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(span) = self.0.take() {
            metrics::request(&self.1, Outcome::Cancelled, tonic::Code::Cancelled);
            span.in_scope(|| tracing::info!("cancelled by the client before dispatch"));
        }
    }
}

//! A response of several choices: `n` per prompt (or `best_of`, of which the best `n` are
//! returned), and a list of prompts in `/v1/completions`. Each choice is its own generation down
//! the generate path, under its own request id ([`MintedId::choice`]), and the choices' chunks
//! are merged into one stream, each tagged with its choice's index.
//!
//! Sharing the prompt: the choices of one prompt start one after the other's first chunk. The
//! first choice's first token means its prompt has been computed and its pages offered to the
//! prefix caches of the workers that computed and received them, and the router's prefix index
//! hears of them, so the others route to the same workers and reuse those pages (in whole prompt
//! blocks, see docs/ARCHITECTURE.md) instead of computing the prompt again. The prompts of a list
//! start at once, after every one of them passed the router's validation (so a list with one
//! bad prompt is refused before anything is scheduled; those prompts are tokenized twice).

use std::collections::BTreeMap;

use axum::http::HeaderValue;
use axum::response::Response;
use nibble_proto::v1;
use tokio::task::JoinSet;
use tokio_stream::{Iter, StreamExt, StreamMap};
use tonic::Status;

use super::error::{ApiError, ParamNames};
use super::generate::{self, GenerateStream, Started};
use crate::service::state::MintedId;
use crate::service::validate::validate;
use crate::InferenceService;

/// One choice to generate.
#[derive(Debug, Clone)]
pub struct Choice {
    /// Its `index` in the response.
    pub index: u32,
    /// Which prompt of the request it completes.
    pub prompt: usize,
    pub request: v1::GenerateRequest,
}

/// Every choice of a response, in index order: `per_prompt` for each request of `prompts`,
/// choice `i` of prompt `p` at index `p * per_prompt + i` (vLLM's order), with seed `seed + i`
/// when a seed is given (so the choices differ, and the same request gives the same choices).
pub fn fan_out(prompts: Vec<v1::GenerateRequest>, per_prompt: u32) -> Vec<Choice> {
    let mut choices = Vec::new();
    for (p, request) in prompts.into_iter().enumerate() {
        for i in 0..per_prompt {
            let mut request = request.clone();
            if let Some(seed) = request.sampling.as_mut().and_then(|s| s.seed.as_mut()) {
                *seed = seed.wrapping_add(u64::from(i));
            }
            choices.push(Choice {
                index: p as u32 * per_prompt + i,
                prompt: p,
                request,
            });
        }
    }
    choices
}

/// The choices' chunks as one stream of (index, chunk): every choice's first chunk, then the
/// rest as they come.
pub type Merged = tokio_stream::adapters::Chain<
    Iter<std::vec::IntoIter<(u32, Result<v1::GenerateResponse, Status>)>>,
    StreamMap<u32, GenerateStream>,
>;

/// The response header naming the decode worker of each choice, in index order.
pub const DECODE_WORKER: &str = "x-nibble-decode-worker";
/// The response header naming the prefill worker of each choice (`-`: its decode worker
/// prefilled it); present only when some choice was disaggregated.
pub const PREFILL_WORKER: &str = "x-nibble-prefill-worker";

/// Where each choice ran, from its first chunk (what gRPC clients read in `route`), for the
/// response's headers: benchmarks attribute requests to workers by them.
#[derive(Debug, Default)]
pub struct Routes(Vec<v1::Route>);

impl Routes {
    /// `response` with the route headers (a worker id that is not a valid header value leaves
    /// its header out).
    pub fn headers(&self, mut response: Response) -> Response {
        let decode = self.0.iter().map(|r| r.decode_worker.as_str());
        let prefill = self.0.iter().map(|r| match r.prefill_worker.as_str() {
            "" => "-",
            id => id,
        });
        let joined = |ids: &mut dyn Iterator<Item = &str>| ids.collect::<Vec<_>>().join(", ");
        let mut set = |name: &'static str, value: String| {
            if let Ok(value) = HeaderValue::from_str(&value) {
                response.headers_mut().insert(name, value);
            }
        };
        if !self.0.is_empty() {
            set(DECODE_WORKER, joined(&mut { decode }));
        }
        if self.0.iter().any(|r| !r.prefill_worker.is_empty()) {
            set(PREFILL_WORKER, joined(&mut { prefill }));
        }
        response
    }
}

/// Starts every choice (see the module header for the order) and waits for each one's first
/// chunk. The first refusal fails the whole response; the choices already started are dropped,
/// which cancels them.
pub async fn start_all(
    service: &InferenceService,
    id: &MintedId,
    choices: Vec<Choice>,
    names: ParamNames,
) -> Result<(Merged, Routes), ApiError> {
    let mut groups: BTreeMap<usize, Vec<Choice>> = BTreeMap::new();
    for choice in choices {
        groups.entry(choice.prompt).or_default().push(choice);
    }
    if groups.len() > 1 {
        let firsts: Vec<v1::GenerateRequest> = groups
            .values()
            .filter_map(|g| g.first().map(|c| c.request.clone()))
            .collect();
        validate_all(service, firsts, names).await?;
    }
    let mut started = Vec::new();
    if groups.len() == 1 {
        // One prompt: no task needed.
        let group = groups.into_values().next().unwrap_or_default();
        started = start_group(service.clone(), id.clone(), group, names).await?;
    } else {
        let mut tasks = JoinSet::new();
        for group in groups.into_values() {
            tasks.spawn(start_group(service.clone(), id.clone(), group, names));
        }
        while let Some(joined) = tasks.join_next().await {
            let group = joined.map_err(|e| ApiError::internal(format!("a choice failed: {e}")))?;
            started.extend(group?);
        }
    }
    started.sort_by_key(|(index, _)| *index);
    let mut firsts = Vec::with_capacity(started.len());
    let mut routes = Routes::default();
    let mut rest = StreamMap::with_capacity(started.len());
    for (
        index,
        Started {
            first,
            rest: stream,
        },
    ) in started
    {
        routes.0.extend(first.route.clone());
        firsts.push((index, Ok(first)));
        rest.insert(index, stream);
    }
    Ok((tokio_stream::iter(firsts).chain(rest), routes))
}

/// Runs the router's validation of each request (blocking: it tokenizes) before any starts.
async fn validate_all(
    service: &InferenceService,
    requests: Vec<v1::GenerateRequest>,
    names: ParamNames,
) -> Result<(), ApiError> {
    let shared = std::sync::Arc::clone(&service.0);
    let check = move || {
        requests
            .into_iter()
            .try_for_each(|r| validate(r, shared.config()).map(drop))
    };
    tokio::task::spawn_blocking(check)
        .await
        .map_err(|e| ApiError::internal(format!("validation task: {e}")))?
        .map_err(|s| ApiError::from_status(&s, names))
}

/// Starts the choices of one prompt: the first alone, the others once it has its first chunk.
async fn start_group(
    service: InferenceService,
    id: MintedId,
    group: Vec<Choice>,
    names: ParamNames,
) -> Result<Vec<(u32, Started)>, ApiError> {
    let mut group = group.into_iter();
    let Some(first) = group.next() else {
        return Ok(Vec::new());
    };
    let lead = start_one(&service, &id, first, names).await?;
    let mut started = vec![lead];
    let mut tasks = JoinSet::new();
    for choice in group {
        let (service, id) = (service.clone(), id.clone());
        tasks.spawn(async move { start_one(&service, &id, choice, names).await });
    }
    while let Some(joined) = tasks.join_next().await {
        let one = joined.map_err(|e| ApiError::internal(format!("a choice failed: {e}")))?;
        started.push(one?);
    }
    Ok(started)
}

/// Starts one choice under its own id.
async fn start_one(
    service: &InferenceService,
    id: &MintedId,
    mut choice: Choice,
    names: ParamNames,
) -> Result<(u32, Started), ApiError> {
    let id = id.choice(choice.index);
    choice.request.request_id = id.to_string();
    let started = generate::start(service, &id, choice.request, names).await?;
    Ok((choice.index, started))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_indexed_by_prompt_then_choice_with_their_own_seeds() {
        let request = |seed| v1::GenerateRequest {
            sampling: Some(v1::SamplingParams {
                seed,
                ..Default::default()
            }),
            ..Default::default()
        };
        let choices = fan_out(vec![request(Some(10)), request(None)], 3);
        let got: Vec<_> = choices
            .iter()
            .map(|c| (c.index, c.prompt, c.request.sampling.as_ref().unwrap().seed))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, Some(10)),
                (1, 0, Some(11)),
                (2, 0, Some(12)),
                (3, 1, None),
                (4, 1, None),
                (5, 1, None),
            ]
        );
    }
}

//! Sending one request and timing its answer: through the router's gRPC `Generate` or its
//! OpenAI HTTP API (`/v1/completions`, streamed, with usage on every chunk so that each chunk's
//! tokens are counted exactly).

use std::time::{Duration, Instant};

use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_security::{AuthChannel, Peers};
use serde_json::Value;

use super::summary::RequestRecord;

/// Which API the requests go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// The router's gRPC Inference API (says which workers served each request).
    Grpc,
    /// The OpenAI-compatible HTTP API (`/v1/completions`).
    Openai,
}

/// A connected client of one cluster.
#[derive(Clone)]
pub enum Client {
    Grpc(InferenceClient<AuthChannel>),
    Http {
        http: reqwest::Client,
        /// `http://host:port`, no trailing slash.
        base: String,
        model: String,
        api_key: Option<String>,
    },
}

/// What one request asks for.
pub struct Ask<'a> {
    pub prompt: &'a [u32],
    pub max_tokens: u32,
    pub ignore_eos: bool,
}

/// One answer: its record's measured fields, and what it generated (for the next turn).
pub struct Answer {
    pub record: RequestRecord,
    pub token_ids: Vec<u32>,
    pub text: String,
}

/// Per-token timing of a stream: the first token's time and every gap after it.
struct Clock {
    start: Instant,
    last: Option<Instant>,
    ttft_ms: Option<f64>,
    itl_ms: Vec<f64>,
}

impl Clock {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: None,
            ttft_ms: None,
            itl_ms: Vec::new(),
        }
    }

    /// `n` tokens arrived now: the first ends the time to first token; a chunk of k later
    /// tokens is k gaps of a k-th of the time since the previous chunk.
    fn tokens(&mut self, n: u32) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let mut n = n;
        match self.last {
            None => {
                self.ttft_ms = Some(ms(now - self.start));
                n -= 1;
                // Tokens after the first in the same chunk came with it.
                self.itl_ms.extend((0..n).map(|_| 0.0));
            }
            Some(last) => {
                let gap = ms(now - last) / f64::from(n);
                self.itl_ms.extend((0..n).map(|_| gap));
            }
        }
        self.last = Some(now);
    }

    fn record(&self) -> RequestRecord {
        RequestRecord {
            ttft_ms: self.ttft_ms,
            itl_ms: self.itl_ms.clone(),
            e2e_ms: ms(self.start.elapsed()),
            ..RequestRecord::default()
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Client {
    /// Connects to the router's gRPC API at `url`.
    pub async fn grpc(url: &str, peers: &Peers) -> Result<Self, String> {
        let channel = peers
            .endpoint(url)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        Ok(Client::Grpc(InferenceClient::new(
            peers.with_token(channel),
        )))
    }

    /// A client of the HTTP API at `base`, asking for `model` (the first `/v1/models` lists
    /// when `None`); checks the server answers.
    pub async fn http(
        base: &str,
        model: Option<&str>,
        api_key: Option<&str>,
    ) -> Result<Self, String> {
        if base.starts_with("https://") {
            return Err(format!(
                "{base}: nibble bench speaks plain HTTP to the OpenAI API; for a TLS cluster use \
                 --api grpc with --tls-ca"
            ));
        }
        let base = match base.contains("://") {
            true => base.trim_end_matches('/').to_string(),
            false => format!("http://{}", base.trim_end_matches('/')),
        };
        let base = base.trim_end_matches("/v1").to_string();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| e.to_string())?;
        let body = get_json(&http, &format!("{base}/v1/models"), api_key).await?;
        let model = match model {
            Some(m) => m.to_string(),
            None => body["data"][0]["id"]
                .as_str()
                .ok_or_else(|| format!("{base}/v1/models lists no model"))?
                .to_string(),
        };
        Ok(Client::Http {
            http,
            base,
            model,
            api_key: api_key.map(str::to_string),
        })
    }

    /// The served model's context length and workers, prefill and decode (0 when the API does
    /// not say).
    pub async fn describe(&self) -> Result<(usize, usize), String> {
        match self {
            Client::Grpc(client) => {
                let models = client
                    .clone()
                    .list_models(v1::ListModelsRequest {})
                    .await
                    .map_err(|s| format!("ListModels: {:?}: {}", s.code(), s.message()))?
                    .into_inner();
                let model = models
                    .models
                    .iter()
                    .find(|m| m.is_default)
                    .or(models.models.first())
                    .ok_or("the router serves no model (no worker registered)")?;
                let workers = model.prefill_workers + model.decode_workers;
                Ok((model.max_context as usize, workers as usize))
            }
            Client::Http {
                http,
                base,
                model,
                api_key,
            } => {
                let models =
                    get_json(http, &format!("{base}/v1/models"), api_key.as_deref()).await?;
                let listed = models["data"]
                    .as_array()
                    .and_then(|d| d.iter().find(|m| m["id"] == model.as_str()))
                    .ok_or_else(|| format!("{base}/v1/models does not list {model}"))?;
                let context = listed["max_model_len"].as_u64().unwrap_or(u64::MAX);
                Ok((context as usize, 0))
            }
        }
    }

    /// Whether the cluster still answers (a fresh call, within two seconds).
    pub async fn alive(&self) -> bool {
        let probe = async {
            match self {
                Client::Grpc(client) => client
                    .clone()
                    .list_models(v1::ListModelsRequest {})
                    .await
                    .is_ok(),
                Client::Http {
                    http,
                    base,
                    api_key,
                    ..
                } => get_json(http, &format!("{base}/v1/models"), api_key.as_deref())
                    .await
                    .is_ok(),
            }
        };
        tokio::time::timeout(Duration::from_secs(2), probe)
            .await
            .unwrap_or(false)
    }

    /// Sends `ask` and times its answer. A failed request is an answer with `error` set.
    pub async fn send(&mut self, ask: &Ask<'_>) -> Answer {
        let mut clock = Clock::new();
        let mut answer = Answer {
            record: RequestRecord::default(),
            token_ids: Vec::new(),
            text: String::new(),
        };
        let outcome = match self {
            Client::Grpc(client) => grpc(client, ask, &mut clock, &mut answer).await,
            Client::Http {
                http,
                base,
                model,
                api_key,
            } => {
                openai(
                    http,
                    base,
                    model,
                    api_key.as_deref(),
                    ask,
                    &mut clock,
                    &mut answer,
                )
                .await
            }
        };
        let measured = clock.record();
        let record = &mut answer.record;
        record.ttft_ms = measured.ttft_ms;
        record.itl_ms = measured.itl_ms;
        record.e2e_ms = measured.e2e_ms;
        record.prompt_tokens = record.prompt_tokens.max(ask.prompt.len() as u32);
        if let Err(e) = outcome {
            record.error = Some(e);
        } else if ask.ignore_eos && record.completion_tokens != ask.max_tokens {
            record.error = Some(format!(
                "asked for {} tokens, got {}",
                ask.max_tokens, record.completion_tokens
            ));
        }
        answer
    }
}

/// GETs `url` and parses its JSON; a non-2xx answer is an error quoting it.
async fn get_json(
    http: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
) -> Result<Value, String> {
    let mut request = http.get(url);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let answer = request
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let status = answer.status();
    let text = answer.text().await.map_err(|e| format!("{url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url} answered {status}: {}", text.trim()));
    }
    serde_json::from_str(&text).map_err(|e| format!("{url} answered {status} without JSON: {e}"))
}

async fn grpc(
    client: &mut InferenceClient<AuthChannel>,
    ask: &Ask<'_>,
    clock: &mut Clock,
    answer: &mut Answer,
) -> Result<(), String> {
    let request = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
            ids: ask.prompt.to_vec(),
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(ask.max_tokens),
            ignore_eos: ask.ignore_eos,
            ..Default::default()
        }),
        ..Default::default()
    };
    let status = |s: tonic::Status| format!("{:?}: {}", s.code(), s.message());
    let mut stream = client.generate(request).await.map_err(status)?.into_inner();
    while let Some(chunk) = stream.message().await.map_err(status)? {
        clock.tokens(chunk.token_ids.len() as u32);
        answer.token_ids.extend(&chunk.token_ids);
        answer.text.push_str(&chunk.text);
        if let Some(route) = chunk.route {
            let record = &mut answer.record;
            record.disaggregated = Some(!route.prefill_worker.is_empty());
            record.decode_worker = Some(route.decode_worker);
            record.prefill_worker =
                (!route.prefill_worker.is_empty()).then_some(route.prefill_worker);
        }
        if let Some(usage) = chunk.usage {
            answer.record.prompt_tokens = usage.prompt_tokens;
            answer.record.cached_tokens = usage.cached_tokens;
            answer.record.completion_tokens = usage.completion_tokens;
        }
    }
    Ok(())
}

async fn openai(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    api_key: Option<&str>,
    ask: &Ask<'_>,
    clock: &mut Clock,
    answer: &mut Answer,
) -> Result<(), String> {
    let body = serde_json::json!({
        "model": model,
        "prompt": ask.prompt,
        "max_tokens": ask.max_tokens,
        "temperature": 0.0,
        "ignore_eos": ask.ignore_eos,
        "stream": true,
        "stream_options": { "include_usage": true, "continuous_usage_stats": true },
    });
    let mut request = http.post(format!("{base}/v1/completions")).json(&body);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let mut response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("HTTP {status}: {}", text.trim()));
    }
    let header = |name: &str| {
        let value = response.headers().get(name)?.to_str().ok()?;
        Some(value.to_string())
    };
    if let Some(decode) = header("x-nibble-decode-worker") {
        let prefill = header("x-nibble-prefill-worker").filter(|p| p != "-");
        let record = &mut answer.record;
        record.disaggregated = Some(prefill.is_some());
        record.decode_worker = Some(decode);
        record.prefill_worker = prefill;
    }
    let mut pending = Vec::new();
    let mut counted = 0u32;
    while let Some(bytes) = response.chunk().await.map_err(|e| e.to_string())? {
        pending.extend_from_slice(&bytes);
        // Server-sent events end with a blank line.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    return Ok(());
                }
                let chunk: Value =
                    serde_json::from_str(data).map_err(|e| format!("bad event {data}: {e}"))?;
                if let Some(error) = chunk.get("error") {
                    return Err(format!("error event: {error}"));
                }
                if let Some(text) = chunk["choices"][0]["text"].as_str() {
                    answer.text.push_str(text);
                }
                let usage = &chunk["usage"];
                if let Some(done) = usage["completion_tokens"].as_u64() {
                    let done = done as u32;
                    clock.tokens(done.saturating_sub(counted));
                    counted = counted.max(done);
                    let record = &mut answer.record;
                    record.completion_tokens = counted;
                    record.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0) as u32;
                    record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0) as u32;
                }
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}

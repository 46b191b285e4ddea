//! The chaos test's requests: one greedy request over gRPC or HTTP (streamed or not), maybe
//! hung up by its client mid-stream, and how it ended, judged: completed with the tokens (or
//! text) its prompt gives alone, hung up, or failed with a clean status. Anything else (a
//! transport error string, a reset connection, a truncated stream, other tokens) is an error
//! the test fails on.

use std::net::SocketAddr;

use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_testkit::http_client;
use tokio::io::AsyncReadExt;
use tonic::Code;

/// Which API a request goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// gRPC `Generate` (always a stream).
    Grpc,
    /// HTTP `/v1/completions`, one JSON answer.
    Http,
    /// HTTP `/v1/completions` with `stream: true` (server-sent events).
    HttpStream,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::Grpc => "grpc",
            Api::Http => "http",
            Api::HttpStream => "http_stream",
        }
    }
}

/// One request of a batch.
#[derive(Debug, Clone)]
pub struct Call {
    /// Index of its prompt.
    pub prompt: usize,
    pub api: Api,
    pub max_tokens: u32,
    /// The client hangs up after this many chunks (events, for HTTP streams; for a
    /// non-streamed HTTP request, before the answer).
    pub hang_up: Option<usize>,
}

/// How a request ended, when it ended well.
#[derive(Debug)]
pub enum Outcome {
    /// Every token asked for, equal to the prompt's solo tokens.
    Completed,
    /// The client hung up, as the call said.
    HungUp,
    /// A clean failure: `CODE: message` or `HTTP STATUS: message`.
    Failed(String),
}

/// A prompt and what it gave when it ran alone.
#[derive(Debug, Clone)]
pub struct Solo {
    pub ids: Vec<u32>,
    pub tokens: Vec<u32>,
    pub text: String,
}

impl Solo {
    /// Runs `ids` alone through the router at `address` (gRPC).
    pub async fn run(address: &str, ids: Vec<u32>) -> Result<Solo, String> {
        let mut client = InferenceClient::connect(format!("http://{address}"))
            .await
            .map_err(|e| e.to_string())?;
        let max_tokens = super::SOLO_TOKENS;
        let request = grpc_request(&ids, max_tokens);
        let got = nibble_testkit::generate(&mut client, request)
            .await
            .map_err(|s| format!("{s:?}"))?;
        if got.tokens.len() != max_tokens as usize {
            return Err(format!("{} tokens, not {max_tokens}", got.tokens.len()));
        }
        Ok(Solo {
            ids,
            tokens: got.tokens,
            text: got.text,
        })
    }
}

/// Words that mean a transport's or a library's error reached a client.
const NOT_CLEAN: [&str; 12] = [
    "transport error",
    "h2 protocol",
    "hyper",
    "tcp connect",
    "error trying to connect",
    "os error",
    "broken pipe",
    "connection reset",
    "Io(",
    "Status {",
    "tonic",
    "untagged enum",
];

/// A failure's message: non-empty and free of transport words.
fn clean_message(message: &str) -> Result<(), String> {
    if message.trim().is_empty() {
        return Err("an empty error message".into());
    }
    match NOT_CLEAN.iter().find(|w| {
        message
            .to_ascii_lowercase()
            .contains(&w.to_ascii_lowercase())
    }) {
        Some(word) => Err(format!("{word:?} in the error message {message:?}")),
        None => Ok(()),
    }
}

fn grpc_request(ids: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds {
            ids: ids.to_vec(),
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Runs `call`; `Err` says how it ended badly.
pub async fn run(
    call: &Call,
    solo: &Solo,
    address: &str,
    http: SocketAddr,
) -> Result<Outcome, String> {
    match call.api {
        Api::Grpc => grpc(call, solo, address).await,
        Api::Http | Api::HttpStream => self::http(call, solo, http).await,
    }
}

/// A failed gRPC call's status, judged.
fn grpc_failure(status: &tonic::Status) -> Result<Outcome, String> {
    let allowed = [
        Code::Unavailable,
        Code::ResourceExhausted,
        Code::DeadlineExceeded,
        Code::Aborted,
        Code::Internal,
    ];
    if !allowed.contains(&status.code()) {
        return Err(format!("status {status:?}"));
    }
    clean_message(status.message())?;
    Ok(Outcome::Failed(format!(
        "{:?}: {}",
        status.code(),
        status.message()
    )))
}

async fn grpc(call: &Call, solo: &Solo, address: &str) -> Result<Outcome, String> {
    let mut client = InferenceClient::connect(format!("http://{address}"))
        .await
        .map_err(|e| format!("connect to the router: {e}"))?;
    let request = grpc_request(&solo.ids, call.max_tokens);
    let mut stream = match client.generate(request).await {
        Ok(stream) => stream.into_inner(),
        Err(status) => return grpc_failure(&status),
    };
    let (mut tokens, mut chunks) = (Vec::new(), 0);
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                tokens.extend(chunk.token_ids);
                chunks += 1;
                if call.hang_up == Some(chunks) {
                    return Ok(Outcome::HungUp);
                }
            }
            Ok(None) => break,
            Err(status) => return grpc_failure(&status),
        }
    }
    let want = &solo.tokens[..call.max_tokens as usize];
    match tokens == want {
        true => Ok(Outcome::Completed),
        false => Err(format!("tokens {tokens:?}, alone {want:?}")),
    }
}

/// An HTTP error answer, judged: a status the API documents for the cluster's failures, with
/// OpenAI's error body.
fn http_failure(status: u16, body: &[u8]) -> Result<Outcome, String> {
    if ![429, 500, 503, 504].contains(&status) {
        return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(body)));
    }
    let message = error_message(body)?;
    Ok(Outcome::Failed(format!("HTTP {status}: {message}")))
}

/// The message of an OpenAI error body (`{"error": {"message": ...}}`), checked clean.
fn error_message(body: &[u8]) -> Result<String, String> {
    let json: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("an error body that is not JSON ({e}): {body:?}"))?;
    let message = json["error"]["message"]
        .as_str()
        .ok_or_else(|| format!("no error.message in {json}"))?;
    clean_message(message)?;
    Ok(message.to_string())
}

async fn http(call: &Call, solo: &Solo, address: SocketAddr) -> Result<Outcome, String> {
    let stream = call.api == Api::HttpStream;
    let body = serde_json::json!({
        "prompt": solo.ids,
        "max_tokens": call.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
    .to_string();
    let address = address.to_string();
    let mut socket = http_client::send(
        &address,
        "POST",
        "/v1/completions",
        &[],
        Some(body.as_bytes()),
    )
    .await;
    if let (false, Some(after)) = (stream, call.hang_up) {
        // The client gives up before the whole answer comes.
        tokio::time::sleep(std::time::Duration::from_millis(150 * after as u64)).await;
        return Ok(Outcome::HungUp);
    }
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket
            .read(&mut buf)
            .await
            .map_err(|e| format!("reading the answer: {e}"))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        // A stream is dropped after its first events.
        if call
            .hang_up
            .is_some_and(|after| count(&raw, b"data: ") >= after)
        {
            return Ok(Outcome::HungUp);
        }
    }
    let chunked = raw
        .windows(26)
        .any(|w| w.eq_ignore_ascii_case(b"transfer-encoding: chunked"));
    if chunked && !raw.ends_with(b"0\r\n\r\n") {
        return Err(format!(
            "a chunked answer cut short: {:?}",
            String::from_utf8_lossy(&raw)
        ));
    }
    if !raw.windows(4).any(|w| w == b"\r\n\r\n") {
        return Err(format!(
            "the connection closed before the headers: {:?}",
            String::from_utf8_lossy(&raw)
        ));
    }
    let response = http_client::parse(&raw);
    if response.status != 200 {
        return http_failure(response.status, &response.body);
    }
    let text = match stream {
        false => {
            let json = response.json();
            json["choices"][0]["text"]
                .as_str()
                .ok_or_else(|| format!("no choices[0].text in {json}"))?
                .to_string()
        }
        true => {
            let events = response.sse_data();
            if events.last().map(String::as_str) != Some("[DONE]") {
                return Err(format!("a stream without [DONE]: {events:?}"));
            }
            let mut text = String::new();
            for event in &events[..events.len() - 1] {
                let json: serde_json::Value = serde_json::from_str(event)
                    .map_err(|e| format!("an event that is not JSON ({e}): {event}"))?;
                if json.get("error").is_some() {
                    let message = error_message(event.as_bytes())?;
                    return Ok(Outcome::Failed(format!("HTTP stream error: {message}")));
                }
                text.push_str(json["choices"][0]["text"].as_str().unwrap_or_default());
            }
            text
        }
    };
    match text == solo.text {
        true => Ok(Outcome::Completed),
        false => Err(format!("text {text:?}, alone {:?}", solo.text)),
    }
}

/// Occurrences of `needle` in `haystack`.
fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

//! A router as tests drive it through its Inference API: a client, and one request streamed to
//! the end.

use std::future::Future;

use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use tonic::transport::Channel;
use tonic::Status;

/// A router a test runs: where its APIs listen.
pub trait RouterApi: Sync {
    /// Its gRPC Inference API (`host:port`).
    fn address(&self) -> &str;

    /// Its HTTP API (`host:port`).
    fn http_address(&self) -> &str;

    /// A plaintext client of its Inference API.
    fn client(&self) -> impl Future<Output = InferenceClient<Channel>> + Send {
        async move {
            InferenceClient::connect(format!("http://{}", self.address()))
                .await
                .expect("connect to the router")
        }
    }
}

/// What a finished stream carried.
#[derive(Debug, Default)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    /// The last chunk's usage (`None`: no chunk carried one).
    pub usage: Option<v1::Usage>,
    /// The finish reason of the chunk that carried the usage.
    pub finish_reason: i32,
    /// Where the request ran (the first chunk's route).
    pub route: Option<v1::Route>,
}

/// Sends `request` and reads its whole stream.
pub async fn generate(
    client: &mut InferenceClient<Channel>,
    request: v1::GenerateRequest,
) -> Result<Generated, Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut out = Generated::default();
    while let Some(chunk) = stream.message().await? {
        out.tokens.extend(chunk.token_ids);
        out.text.push_str(&chunk.text);
        if chunk.route.is_some() {
            out.route = chunk.route;
        }
        if let Some(usage) = chunk.usage {
            out.usage = Some(usage);
            out.finish_reason = chunk.finish_reason;
        }
    }
    Ok(out)
}

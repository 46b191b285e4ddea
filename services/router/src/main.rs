//! `nibble-router`: the router. Parses the command line and runs [`nibble_router::serve`].

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery};
use nibble_engine::ModelSource;
use nibble_router::{HttpConfig, HttpListener, RouterConfig, ServiceConfig, Shared};

/// nibble's router: the public Inference API, placing requests on prefill and decode workers.
#[derive(Debug, Parser)]
#[command(name = "nibble-router", version)]
struct Cli {
    /// Address the Inference API listens on.
    #[arg(long, env = "NIBBLE_ROUTER_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
    /// Address the OpenAI-compatible HTTP API listens on.
    #[arg(long, env = "NIBBLE_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    http_listen: String,
    /// Serve no HTTP API (only gRPC).
    #[arg(long, env = "NIBBLE_NO_HTTP")]
    no_http: bool,
    /// Bearer key the HTTP API requires on every /v1 request; unset leaves it open.
    #[arg(long, env = "NIBBLE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Largest HTTP request body, in bytes (413 above).
    #[arg(long, env = "NIBBLE_HTTP_MAX_BODY_BYTES", default_value_t = nibble_router::http::DEFAULT_MAX_BODY_BYTES)]
    http_max_body_bytes: usize,
    /// The model file (GGUF) whose tokenizer and chat template the router uses.
    #[arg(long, env = "NIBBLE_MODEL")]
    model: PathBuf,
    /// The model's name, as workers register it and clients ask for it.
    #[arg(long, env = "NIBBLE_MODEL_NAME", default_value = "default")]
    model_name: String,
    /// Tokens per KV page (the workers' page size).
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    page_size: u32,
    /// etcd client URLs (comma-separated).
    #[arg(
        long,
        env = "NIBBLE_ETCD_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    etcd_endpoints: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let source = ModelSource::open(&cli.model)
        .with_context(|| format!("opening {}", cli.model.display()))?;
    let tokenizer = Arc::new(source.load_tokenizer()?);
    let max_context = source.config()?.max_context as u32;
    let discovery: Arc<dyn Discovery> =
        Arc::new(EtcdDiscovery::connect(EtcdConfig::new(cli.etcd_endpoints)).await?);
    let listener = tokio::net::TcpListener::bind(&cli.listen).await?;
    eprintln!("nibble-router listening on {}", listener.local_addr()?);
    let config = ServiceConfig {
        router: RouterConfig::new(cli.model_name, cli.page_size),
        tokenizer,
        max_context,
    };
    let http = if cli.no_http {
        None
    } else {
        let listener = tokio::net::TcpListener::bind(&cli.http_listen).await?;
        eprintln!(
            "nibble-router HTTP API on http://{}",
            listener.local_addr()?
        );
        Some(HttpListener {
            listener,
            config: HttpConfig {
                api_key: cli.api_key,
                max_body_bytes: cli.http_max_body_bytes,
            },
        })
    };
    nibble_router::serve_shared_with_http(
        listener,
        http,
        Shared::new(config)?,
        Arc::clone(&discovery),
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    )
    .await?;
    let _ = discovery.close().await;
    Ok(())
}

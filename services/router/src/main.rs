//! `nibble-router`: the router. Parses the command line and runs [`nibble_router::serve_with_http`].

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use nibble_discovery::{Discovery, EtcdConfig, EtcdDiscovery};
use nibble_engine::ModelSource;
use nibble_router::http::HttpArgs;
use nibble_router::{RouterConfig, ServiceConfig};

/// nibble's router: the public Inference API, placing requests on prefill and decode workers.
#[derive(Debug, Parser)]
#[command(name = "nibble-router", version)]
struct Cli {
    /// Address the Inference API listens on.
    #[arg(long, env = "NIBBLE_ROUTER_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
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
    #[command(flatten)]
    http: HttpArgs,
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
    let http = cli.http.bind().await?;
    if let Some(http) = &http {
        eprintln!(
            "nibble-router HTTP API on http://{}",
            http.listener.local_addr()?
        );
    }
    nibble_router::serve_with_http(listener, http, config, Arc::clone(&discovery), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    let _ = discovery.close().await;
    Ok(())
}

//! The HTTP API's command-line flags, [`HttpArgs`], to flatten into a binary's arguments
//! (`nibble-router`; `nibble up` too), every flag also an environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use super::limits::{
    fds, ConnectionLimits, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
};
use super::{HttpConfig, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS};
use crate::HttpListener;

/// Where and how the OpenAI-compatible HTTP API is served.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Address the OpenAI-compatible HTTP API listens on.
    #[arg(long, env = "NIBBLE_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    pub http_listen: SocketAddr,
    /// Serve no HTTP API (gRPC only).
    #[arg(long, env = "NIBBLE_NO_HTTP")]
    pub no_http: bool,
    /// Bearer key every /v1 HTTP request and every gRPC Inference call must carry
    /// (`Authorization: Bearer KEY`); unset leaves both APIs open.
    #[arg(long, env = "NIBBLE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest HTTP request body, in bytes (413 above).
    #[arg(long, env = "NIBBLE_HTTP_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub http_max_body_bytes: usize,
    /// HTTP connections open at once. At the cap, a new connection closes the one idle longest
    /// among those not being answered; only when all are being answered is it refused (503).
    /// Default: half the process's open-file limit (raised to its hard limit at start-up),
    /// between 256 and 65536.
    #[arg(long, env = "NIBBLE_HTTP_MAX_CONNECTIONS")]
    pub http_max_connections: Option<usize>,
    /// Seconds an HTTP connection may move no byte while none of its requests is being answered
    /// (an idle keep-alive, a connection that sends nothing) before it is closed.
    #[arg(long, env = "NIBBLE_HTTP_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub http_idle_timeout_secs: u64,
    /// Seconds a request's headers may take from their first byte; past it the connection is
    /// closed, however steadily the bytes come.
    #[arg(long, env = "NIBBLE_HTTP_HEADER_TIMEOUT_SECS", default_value_t = DEFAULT_HEADER_TIMEOUT.as_secs())]
    pub http_header_timeout_secs: u64,
    /// Seconds a request's whole body may take after its headers; past it the request gets 408
    /// and the connection is closed.
    #[arg(long, env = "NIBBLE_HTTP_BODY_TIMEOUT_SECS", default_value_t = DEFAULT_BODY_TIMEOUT.as_secs())]
    pub http_body_timeout_secs: u64,
    /// Largest `n` (choices per prompt) and `best_of` of an HTTP request (400 above).
    #[arg(long, env = "NIBBLE_MAX_N", default_value_t = DEFAULT_MAX_N)]
    pub max_n: u32,
    /// Most prompts in one /v1/completions request (400 above).
    #[arg(long, env = "NIBBLE_MAX_PROMPTS", default_value_t = DEFAULT_MAX_PROMPTS)]
    pub max_prompts: usize,
}

impl HttpArgs {
    /// The API's settings.
    pub fn config(&self) -> HttpConfig {
        HttpConfig {
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            max_body_bytes: self.http_max_body_bytes,
            limits: ConnectionLimits {
                max_connections: self
                    .http_max_connections
                    .unwrap_or_else(|| fds::default_max_connections(fds::open_file_limit()))
                    .max(1),
                idle_timeout: Duration::from_secs(self.http_idle_timeout_secs.max(1)),
                header_timeout: Duration::from_secs(self.http_header_timeout_secs.max(1)),
                body_timeout: Duration::from_secs(self.http_body_timeout_secs.max(1)),
            },
            // The binary sets it: whether metrics are on is not an HTTP flag.
            metrics: None,
            max_n: self.max_n.max(1),
            max_prompts: self.max_prompts.max(1),
        }
    }

    /// Binds the API's listener, unless `--no-http` (an address in use is an error naming
    /// `--http-listen`), after raising the process's open-file limit to its hard limit (the
    /// default connection cap follows it).
    pub async fn bind(&self) -> std::io::Result<Option<HttpListener>> {
        if self.no_http {
            return Ok(None);
        }
        fds::raise_open_file_limit();
        let listener = nibble_telemetry::listen::bind("--http-listen", self.http_listen).await?;
        Ok(Some(HttpListener {
            listener,
            config: self.config(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        http: HttpArgs,
    }

    #[test]
    fn defaults_and_flags() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.http.http_listen.to_string(), "127.0.0.1:8000");
        assert!(!cli.http.no_http);
        let config = cli.http.config();
        assert_eq!(config.api_key, None);
        assert_eq!(
            config.limits.max_connections,
            fds::default_max_connections(fds::open_file_limit())
        );
        assert_eq!(config.limits.header_timeout, DEFAULT_HEADER_TIMEOUT);
        assert_eq!(config.limits.body_timeout, DEFAULT_BODY_TIMEOUT);
        let cli = Cli::try_parse_from([
            "x",
            "--http-listen",
            "0.0.0.0:9000",
            "--api-key",
            "k",
            "--http-max-body-bytes",
            "10",
            "--max-n",
            "4",
            "--http-max-connections",
            "64",
            "--http-header-timeout-secs",
            "3",
            "--http-body-timeout-secs",
            "5",
        ])
        .unwrap();
        assert_eq!(cli.http.http_listen.port(), 9000);
        let config = cli.http.config();
        assert_eq!(config.api_key.as_deref(), Some("k"));
        assert_eq!(config.max_body_bytes, 10);
        assert_eq!((config.max_n, config.max_prompts), (4, DEFAULT_MAX_PROMPTS));
        assert_eq!(config.limits.max_connections, 64);
        assert_eq!(config.limits.header_timeout, Duration::from_secs(3));
        assert_eq!(config.limits.body_timeout, Duration::from_secs(5));
        assert!(Cli::try_parse_from(["x", "--http-listen", "nowhere"]).is_err());
    }
}

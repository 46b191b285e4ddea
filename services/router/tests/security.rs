//! Transport security end to end on loopback with the real model: a router and prefill and
//! decode workers with TLS (mutual between services), the internal token and an API key, and
//! clients that have, lack or fake each of them. Certificates come from a CA made by the test
//! (`nibble_security::testing`); no key is committed.

mod support;

use clap::Parser;
use nibble_discovery::{Role, StaticRegistry};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_proto::v1::inference_client::InferenceClient;
use nibble_proto::v1::kv_transfer_client::KvTransferClient;
use nibble_proto::v1::worker_client::WorkerClient;
use nibble_router::HttpConfig;
use nibble_security::testing::TestPki;
use nibble_security::{AuthChannel, Peers, Secret, Security, SecurityArgs};
use nibble_testkit::http_client::{self, HttpResponse};
use nibble_testkit::{reference, RouterApi, WorkerApi};
use support::{greedy_request, prompt, RouterServer, Worker, NEW_TOKENS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;

const TOKEN: &str = "internal-token-for-tests";
const API_KEY: &str = "api-key-for-tests";
const DTYPE: KvDtype = KvDtype::Nvfp4;

/// A TLS cluster: every service has the certificate `node` (for 127.0.0.1 and localhost),
/// trusts the test CA, requires the internal token; the router requires the API key.
struct Secured {
    pki: TestPki,
    prefill: Worker,
    decode: Worker,
    router: RouterServer,
    _registry: StaticRegistry,
}

impl Secured {
    async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    async fn start_with(configure: impl FnOnce(&mut nibble_router::ServiceConfig)) -> Self {
        let pki = TestPki::new("nibble test CA");
        let node = pki.issue("node", &["127.0.0.1", "localhost"]);
        let security = pki.security(&node, Some(TOKEN)).load().unwrap();
        let registry = StaticRegistry::new();
        let start = |role, name| {
            Worker::start_secured(
                &registry,
                role,
                name,
                support::engine(DTYPE),
                security.clone(),
            )
        };
        let prefill = start(Role::Prefill, "p0").await;
        let decode = start(Role::Decode, "d0").await;
        let router_security = security.clone();
        let router = RouterServer::start(
            &registry,
            prefill.state.engine().info().page_size as u32,
            HttpConfig {
                api_key: Some(API_KEY.into()),
                ..HttpConfig::default()
            },
            move |config| {
                config.security = router_security;
                config.api_key = Secret::new(API_KEY);
                configure(config);
            },
        )
        .await;
        router.wait_for_workers(1, 1).await;
        Self {
            pki,
            prefill,
            decode,
            router,
            _registry: registry,
        }
    }

    fn ca(&self) -> Certificate {
        Certificate::from_pem(std::fs::read(&self.pki.ca).unwrap())
    }

    /// A client trusting the test CA, presenting `identity` and sending `token`.
    fn peers(&self, identity: Option<Identity>, token: Option<&str>) -> Peers {
        let mut tls = ClientTlsConfig::new().ca_certificate(self.ca());
        if let Some(identity) = identity {
            tls = tls.identity(identity);
        }
        Peers::new(Some(tls), token.and_then(Secret::new)).unwrap()
    }

    /// A client certificate the CA signed (for a service other than the workers).
    fn client_identity(&self) -> Identity {
        let files = self.pki.issue("client", &["client.local"]);
        Identity::from_pem(
            std::fs::read(files.cert).unwrap(),
            std::fs::read(files.key).unwrap(),
        )
    }

    async fn router_client(&self, key: Option<&str>) -> InferenceClient<AuthChannel> {
        let peers = self.peers(None, key);
        let channel = peers
            .endpoint(&self.router.address)
            .unwrap()
            .connect()
            .await;
        InferenceClient::new(peers.with_token(channel.unwrap()))
    }

    fn worker_client(&self, worker: &Worker, token: Option<&str>) -> WorkerClient<AuthChannel> {
        let peers = self.peers(Some(self.client_identity()), token);
        WorkerClient::new(peers.connect_lazy(&worker.address).unwrap())
    }
}

/// Streams a request to its end; its tokens.
async fn generate(
    client: &mut InferenceClient<AuthChannel>,
    request: v1::GenerateRequest,
) -> Result<Vec<u32>, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(chunk) = stream.message().await? {
        tokens.extend(chunk.token_ids);
    }
    Ok(tokens)
}

/// One HTTPS request to `address`, trusting `ca`.
async fn https(
    address: &str,
    ca: &std::path::Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<HttpResponse> {
    use tokio_rustls::rustls;
    let tcp = tokio::net::TcpStream::connect(address).await?;
    let ip: std::net::SocketAddr = address.parse().unwrap();
    let name = rustls::pki_types::ServerName::IpAddress(ip.ip().into());
    let mut tls = nibble_testkit::tls::connector(ca)?
        .connect(name, tcp)
        .await?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        head.push_str("\r\n");
    }
    tls.write_all(head.as_bytes()).await?;
    let mut raw = Vec::new();
    // A TLS peer may close without close_notify once the response is complete.
    let _ = tls.read_to_end(&mut raw).await;
    Ok(http_client::parse(&raw))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_serves_grpc_and_https_end_to_end() {
    let expected = reference(DTYPE, &[prompt()], NEW_TOKENS).remove(0);
    let cluster = Secured::start().await;

    // gRPC over TLS with the API key: router → (TLS, token) → prefill → pages → decode.
    let mut client = cluster.router_client(Some(API_KEY)).await;
    let tokens = generate(&mut client, greedy_request("tls")).await.unwrap();
    assert_eq!(
        tokens, expected,
        "the TLS cluster gives the engine's tokens"
    );
    assert!(
        cluster.decode.state.counters().totals().pages_received > 0,
        "the prefill worker pushed pages to the decode worker over mutual TLS"
    );
    cluster.decode.pages_back().await;
    cluster.prefill.pages_back().await;

    // HTTPS with the API key.
    let ca = cluster.pki.ca.clone();
    let auth = format!("Bearer {API_KEY}");
    let http = cluster.router.http_address();
    let models = https(
        http,
        &ca,
        "GET",
        "/v1/models",
        &[("Authorization", &auth)],
        None,
    )
    .await
    .unwrap();
    assert_eq!(models.status, 200, "{}", models.text());
    let body = r#"{"prompt": "Hello", "max_tokens": 4, "temperature": 0}"#;
    let completion = https(
        http,
        &ca,
        "POST",
        "/v1/completions",
        &[("Authorization", &auth)],
        Some(body),
    )
    .await
    .unwrap();
    assert_eq!(completion.status, 200, "{}", completion.text());
    assert_eq!(completion.json()["usage"]["completion_tokens"], 4);

    // Probes stay open, over TLS.
    let health = https(http, &ca, "GET", "/health", &[], None).await.unwrap();
    assert_eq!(health.status, 200);
    let channel = cluster
        .peers(None, None)
        .endpoint(&cluster.router.address)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let serving = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(serving.status, 1, "grpc.health.v1 needs no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_the_ca_or_the_key_are_refused() {
    let cluster = Secured::start().await;
    let address = &cluster.router.address;

    // Plaintext to a TLS port.
    let plain = Endpoint::from_shared(format!("http://{address}")).unwrap();
    let refused = match plain.connect().await {
        Err(_) => true,
        Ok(channel) => InferenceClient::new(channel)
            .list_models(v1::ListModelsRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a plaintext client gets nothing from a TLS router");

    // TLS trusting another CA: the handshake fails.
    let other = TestPki::new("another CA");
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&other.ca).unwrap()));
    let endpoint = Endpoint::from_shared(format!("https://{address}"))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    assert!(
        endpoint.connect().await.is_err(),
        "a client that does not trust the router's CA cannot connect"
    );
    let https_other = https(
        cluster.router.http_address(),
        &other.ca,
        "GET",
        "/health",
        &[],
        None,
    )
    .await;
    assert!(https_other.is_err(), "nor over HTTPS");

    // The right CA, a wrong or missing API key: UNAUTHENTICATED, and HTTP 401.
    for key in [None, Some("wrong-key")] {
        let mut client = cluster.router_client(key).await;
        let status = generate(&mut client, greedy_request("no-key"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(status.message().contains("API key"), "{status:?}");
        let status = client
            .tokenize(v1::TokenizeRequest {
                text: "x".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated);

        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let response = https(
            cluster.router.http_address(),
            &cluster.pki.ca,
            "GET",
            "/v1/models",
            &headers,
            None,
        )
        .await
        .unwrap();
        assert_eq!(response.status, 401, "{}", response.text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_require_a_client_certificate_and_the_internal_token() {
    let cluster = Secured::start().await;
    let (prefill, decode) = (&cluster.prefill, &cluster.decode);

    // mTLS: the CA and the token, but no client certificate.
    let peers = cluster.peers(None, Some(TOKEN));
    let refused = match peers.endpoint(&decode.address).unwrap().connect().await {
        Err(_) => true,
        Ok(channel) => WorkerClient::new(peers.with_token(channel))
            .load(v1::LoadRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a worker refuses a client without a certificate");

    // A certificate the CA signed, with the token: served.
    let mut good = cluster.worker_client(decode, Some(TOKEN));
    good.load(v1::LoadRequest {}).await.unwrap();

    // A certificate without the token, or with a wrong one: UNAUTHENTICATED on every call that
    // changes state (and on the ones that read it).
    for token in [None, Some("wrong-token")] {
        let mut d = cluster.worker_client(decode, token);
        let mut p = cluster.worker_client(prefill, token);
        let unauthenticated = |what: &str, result: Result<(), tonic::Status>| {
            let status = result.expect_err(what);
            assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
            assert!(status.message().contains("internal token"), "{status:?}");
        };
        unauthenticated(
            "Reserve",
            d.reserve(v1::ReserveRequest {
                request_id: "r".into(),
                token_ids: vec![1, 2, 3],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        unauthenticated(
            "Prefill",
            p.prefill(v1::PrefillRequest {
                request_id: "r".into(),
                token_ids: vec![1, 2, 3],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        unauthenticated(
            "Decode",
            d.decode(v1::DecodeRequest {
                request_id: "r".into(),
                token_ids: vec![1, 2, 3],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        unauthenticated(
            "Abort",
            d.abort(v1::AbortRequest {
                request_id: "r".into(),
            })
            .await
            .map(drop),
        );
        unauthenticated("Load", d.load(v1::LoadRequest {}).await.map(drop));
        unauthenticated(
            "SubscribeKvEvents",
            d.subscribe_kv_events(v1::SubscribeKvEventsRequest {})
                .await
                .map(drop),
        );
        let peers = cluster.peers(Some(cluster.client_identity()), token);
        let mut transfer = KvTransferClient::new(peers.connect_lazy(&decode.address).unwrap());
        let pages = tokio_stream::iter(vec![v1::PushPagesRequest {
            reservation_id: 1,
            page_indices: vec![0],
            data: vec![0; 16].into(),
            kv_format_fingerprint: Some(decode.state.engine().info().fingerprint),
            request_id: "r".into(),
        }]);
        unauthenticated("PushPages", transfer.push_pages(pages).await.map(drop));
    }
    assert_eq!(
        decode.state.pending_reservations(),
        0,
        "nothing was reserved"
    );
    assert_eq!(decode.state.counters().totals().pages_received, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_above_the_limit_and_oversized_requests_are_refused() {
    let cluster = Secured::start_with(|config| config.max_tokens_limit = 8).await;
    let mut client = cluster.router_client(Some(API_KEY)).await;
    let mut request = greedy_request("too-many");
    request.stopping.as_mut().unwrap().max_tokens = Some(9);
    let status = generate(&mut client, request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("stopping.max_tokens") && status.message().contains("8"),
        "{status:?}"
    );
    // At the limit: served.
    let mut request = greedy_request("at-limit");
    request.stopping.as_mut().unwrap().max_tokens = Some(8);
    assert_eq!(generate(&mut client, request).await.unwrap().len(), 8);

    let auth = format!("Bearer {API_KEY}");
    let response = https(
        cluster.router.http_address(),
        &cluster.pki.ca,
        "POST",
        "/v1/completions",
        &[("Authorization", &auth)],
        Some(r#"{"prompt": "Hello", "max_tokens": 9}"#),
    )
    .await
    .unwrap();
    assert_eq!(response.status, 400, "{}", response.text());
    assert_eq!(response.json()["error"]["param"], "max_tokens");

    // A request message larger than the public API takes.
    let mut request = greedy_request("huge");
    request.prompt = Some(v1::generate_request::Prompt::Text(
        "a".repeat(nibble_router::server::MAX_REQUEST_BYTES + 1),
    ));
    let status = generate(&mut client, request).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
}

#[derive(Parser)]
struct RouterCli {
    #[command(flatten)]
    args: nibble_router::cli::RouterArgs,
}

#[derive(Parser)]
struct WorkerCli {
    #[command(flatten)]
    args: nibble_worker::WorkerArgs,
}

#[tokio::test]
async fn bad_certificate_files_fail_before_serving_and_name_the_flag() {
    let pki = TestPki::new("nibble test CA");
    let node = pki.issue("node", &["127.0.0.1"]);
    let missing = pki.path("missing.pem");
    let (cert, key, ca) = (
        node.cert.display().to_string(),
        node.key.display().to_string(),
        pki.ca.display().to_string(),
    );
    let missing = missing.display().to_string();
    // The model does not exist either: the TLS files are checked first.
    let common = ["x", "--model", "/nonexistent/model.gguf"];
    let cases: [(&str, [&str; 6]); 3] = [
        (
            "--tls-cert",
            ["--tls-cert", &missing, "--tls-key", &key, "--tls-ca", &ca],
        ),
        (
            "--tls-key",
            ["--tls-cert", &cert, "--tls-key", &missing, "--tls-ca", &ca],
        ),
        (
            "--tls-ca",
            ["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &missing],
        ),
    ];
    for (flag, tls) in cases {
        let argv: Vec<&str> = common.iter().chain(tls.iter()).copied().collect();
        let mut router_argv = argv.clone();
        router_argv.extend(["--etcd-endpoints", "http://127.0.0.1:1", "--no-http"]);
        let router = RouterCli::try_parse_from(&router_argv).unwrap();
        let e = format!(
            "{:#}",
            nibble_router::cli::run(router.args).await.unwrap_err()
        );
        assert!(e.starts_with(flag) && e.contains(&missing), "router: {e}");

        let worker = WorkerCli::try_parse_from(&argv).unwrap();
        let e = nibble_worker::run(Role::Decode, worker.args)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(flag) && e.contains(&missing), "worker: {e}");
    }

    // A router with a CA but no certificate could not pass the workers' mutual TLS.
    let router = RouterCli::try_parse_from(common.iter().copied().chain([
        "--tls-ca",
        ca.as_str(),
        "--etcd-endpoints",
        "http://127.0.0.1:1",
    ]))
    .unwrap();
    let e = format!(
        "{:#}",
        nibble_router::cli::run(router.args).await.unwrap_err()
    );
    assert!(e.contains("--tls-ca needs --tls-cert"), "{e}");

    // A worker serving TLS needs the CA to dial its peers.
    let worker = WorkerCli::try_parse_from(common.iter().copied().chain([
        "--tls-cert",
        cert.as_str(),
        "--tls-key",
        key.as_str(),
    ]))
    .unwrap();
    let e = nibble_worker::run(Role::Prefill, worker.args)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tls-ca"), "{e}");
}

#[test]
fn security_flags_come_from_the_environment_names_the_chart_sets() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        security: SecurityArgs,
    }
    let cli = Cli::try_parse_from(["x", "--internal-token", "t", "--tls-ca", "/ca.pem"]).unwrap();
    assert_eq!(cli.security.internal_token.as_deref(), Some("t"));
    let help = <Cli as clap::CommandFactory>::command()
        .render_long_help()
        .to_string();
    for var in [
        "NIBBLE_TLS_CERT",
        "NIBBLE_TLS_KEY",
        "NIBBLE_TLS_CA",
        "NIBBLE_INTERNAL_TOKEN",
    ] {
        assert!(help.contains(var), "{var} in {help}");
    }
    let _: Security = Security::default();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_a_certificate_and_no_ca_serves_tls_and_dials_plaintext_workers() {
    let expected = reference(DTYPE, &[prompt()], NEW_TOKENS).remove(0);
    let pki = TestPki::new("nibble test CA");
    let node = pki.issue("node", &["127.0.0.1"]);
    let registry = StaticRegistry::new();
    let prefill = Worker::start(&registry, Role::Prefill, "p0", DTYPE).await;
    let decode = Worker::start(&registry, Role::Decode, "d0", DTYPE).await;
    let public_only = SecurityArgs {
        tls: nibble_security::TlsArgs {
            tls_ca: None,
            ..pki.args(&node)
        },
        internal_token: None,
    }
    .load()
    .unwrap();
    let router = RouterServer::start(
        &registry,
        prefill.state.engine().info().page_size as u32,
        HttpConfig::default(),
        move |config| config.security = public_only,
    )
    .await;
    router.wait_for_workers(1, 1).await;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&pki.ca).unwrap()));
    let peers = Peers::new(Some(tls), None).unwrap();
    let channel = peers.endpoint(&router.address).unwrap().connect().await;
    let mut client = InferenceClient::new(peers.with_token(channel.unwrap()));
    let tokens = generate(&mut client, greedy_request("public-tls"))
        .await
        .unwrap();
    assert_eq!(tokens, expected);
    assert!(decode.state.counters().totals().pages_received > 0);
}

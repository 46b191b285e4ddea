//! What a starting process says when it cannot start, run on the built `nibble` binary: a port
//! in use is reported at once, naming the flag and the address, before any model is opened
//! (the model paths here do not exist, so any attempt to open one would fail differently), and
//! an unreachable etcd is one line of hint per retry, with no debug structure, and a worker
//! whose internal API would be open beyond loopback refuses to start.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nibble_testkit::model_path;

/// A model path that does not exist: opening it would fail with another message.
const NO_MODEL: &str = "/nonexistent/nibble-startup-test.gguf";

/// An etcd endpoint nothing listens on.
fn closed_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{address}")
}

/// Runs `nibble ARGS` to its end (at most 20 s) and returns its status, stderr and how long it
/// ran.
fn run(args: &[&str]) -> (std::process::ExitStatus, String, Duration) {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .env_remove("NIBBLE_METRICS_LISTEN")
        .env_remove("NIBBLE_HTTP_LISTEN")
        .env_remove("NIBBLE_ROUTER_LISTEN")
        .env_remove("NIBBLE_LISTEN")
        .env_remove("NIBBLE_INTERNAL_TOKEN")
        .env_remove("NIBBLE_ALLOW_UNAUTHENTICATED_INTERNAL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nibble");
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            return (status, stderr, start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("nibble {args:?} still running after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_port_in_use_is_reported_before_anything_loads() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().to_string();
    let etcd = closed_endpoint();
    let free = "127.0.0.1:0";
    let router = ["--listen", "--http-listen", "--metrics-listen"];
    let worker = ["--listen", "--metrics-listen"];
    let up = [
        "--listen",
        "--http-listen",
        "--prefill-listen",
        "--decode-listen",
        "--metrics-listen",
    ];
    for (command, flags) in [
        ("router", &router[..]),
        ("prefill", &worker[..]),
        ("decode", &worker[..]),
        ("up", &up[..]),
    ] {
        for flag in flags {
            // Every other port free, so only this one can be in use.
            let mut args = vec![command];
            for other in flags {
                args.extend([*other, if other == flag { &busy } else { free }]);
            }
            args.extend(["--model", NO_MODEL]);
            if command != "up" {
                args.extend(["--etcd-endpoints", &etcd]);
            }
            let (status, stderr, took) = run(&args);
            assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
            let expected = format!("{flag} {busy} is already in use");
            assert!(stderr.contains(&expected), "{args:?}: {stderr}");
            assert!(
                !stderr.contains("nibble-startup-test"),
                "{args:?}: {stderr}"
            );
            assert!(took < Duration::from_secs(5), "{args:?}: took {took:?}");
        }
    }
}

#[test]
fn several_workers_of_a_role_on_one_fixed_port_are_refused_before_anything_loads() {
    let args = [
        "up",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--decode-workers",
        "2",
        "--decode-listen",
        "127.0.0.1:47001",
        "--model",
        NO_MODEL,
    ];
    let (status, stderr, _) = run(&args);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--decode-listen 127.0.0.1:47001 names one port, but 2 decode workers"),
        "{stderr}"
    );
    assert!(!stderr.contains("nibble-startup-test"), "{stderr}");
}

#[test]
fn a_worker_open_beyond_loopback_without_authentication_is_refused() {
    let free = "127.0.0.1:0";
    let any = "0.0.0.0:0";
    let cases: [(&[&str], &str); 3] = [
        (
            &["decode", "--listen", any, "--metrics-listen", free],
            "--listen",
        ),
        (&["prefill", "--listen", any, "--no-metrics"], "--listen"),
        (
            &[
                "up",
                "--listen",
                free,
                "--http-listen",
                free,
                "--decode-listen",
                any,
            ],
            "--decode-listen",
        ),
    ];
    for (args, flag) in cases {
        let mut args = args.to_vec();
        args.extend(["--model", NO_MODEL]);
        let (status, stderr, took) = run(&args);
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        let expected = format!("{flag} 0.0.0.0:0 takes connections from other machines");
        assert!(stderr.contains(&expected), "{args:?}: {stderr}");
        for named in [
            "--internal-token",
            "--tls-ca",
            "--allow-unauthenticated-internal",
        ] {
            assert!(stderr.contains(named), "{args:?}: {stderr}");
        }
        assert!(took < Duration::from_secs(5), "{args:?}: took {took:?}");
        // With a token, or the opt-out, it goes on to open the model (which does not exist).
        for extra in [
            &["--internal-token", "t"][..],
            &["--allow-unauthenticated-internal"][..],
        ] {
            let mut args = args.clone();
            args.extend(extra);
            let (status, stderr, _) = run(&args);
            assert_ne!(status.code(), Some(0), "{args:?}");
            assert!(!stderr.contains(&expected), "{args:?}: {stderr}");
            assert!(stderr.contains("nibble-startup-test"), "{args:?}: {stderr}");
        }
    }
}

/// Reads `nibble ARGS`'s stderr until a line contains `wanted` (at most 20 s), then kills it.
fn first_line_with(args: &[&str], wanted: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .env_remove("NIBBLE_LOG_FORMAT")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nibble");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let start = Instant::now();
    let mut seen = Vec::new();
    let found = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains(wanted) => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) if start.elapsed() > Duration::from_secs(20) => break None,
            Err(_) => {}
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    found.unwrap_or_else(|| panic!("no line with {wanted:?} in 20 s: {seen:#?}"))
}

#[test]
fn an_unreachable_etcd_is_one_line_with_a_hint() {
    let etcd = closed_endpoint();
    let model = model_path();
    let model = model.to_str().unwrap();
    let free = "127.0.0.1:0";
    let router = [
        "router",
        "--model",
        model,
        "--etcd-endpoints",
        &etcd,
        "--listen",
        free,
        "--http-listen",
        free,
        "--metrics-listen",
        free,
    ];
    let prefill = [
        "prefill",
        "--model",
        model,
        "--etcd-endpoints",
        &etcd,
        "--listen",
        free,
        "--metrics-listen",
        free,
    ];
    for args in [&router[..], &prefill[..]] {
        let line = first_line_with(args, "is not reachable");
        let hint = format!(
            "etcd at {etcd} is not reachable (connection refused); retrying in 0.2 s — is etcd \
             running? (--etcd-endpoints)"
        );
        assert!(line.contains(&hint), "{args:?}: {line}");
        assert!(line.contains("WARN"), "{line}");
        assert!(!line.contains('{') && !line.contains("Status"), "{line}");
    }
}

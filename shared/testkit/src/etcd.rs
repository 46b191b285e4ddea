//! A real etcd for tests: `/usr/bin/etcd` (Debian package etcd-server) or `$NIBBLE_ETCD_BIN`,
//! on free loopback ports with a temporary data directory, killed when dropped.
//!
//! Ports come from below the kernel's ephemeral range (which starts at 32768 by default), so
//! that no outgoing connection of a test running alongside can take one between the moment it
//! is chosen and the moment etcd binds it; a start that still loses the race picks new ports.
//!
//! A missing binary fails the test with instructions; it never skips.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

const DEFAULT_BIN: &str = "/usr/bin/etcd";
const READY_WAIT: Duration = Duration::from_secs(30);
/// Ports are chosen in `PORTS`, below the default ephemeral range.
const PORTS: std::ops::Range<u16> = 20_000..32_000;
const START_ATTEMPTS: usize = 8;

pub struct EtcdServer {
    bin: PathBuf,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A loopback port in `PORTS` that nothing listens on now: candidates are spread by the process
/// id, the clock and a counter, so parallel tests and test binaries rarely try the same one.
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let span = u64::from(PORTS.end - PORTS.start);
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let mix = (u64::from(std::process::id()) << 32 | u64::from(nanos))
            .wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let port = PORTS.start + ((mix >> 32) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// How a start ended when etcd did not come up.
enum StartError {
    /// Another process bound one of the ports first: worth another try on other ports.
    PortTaken(String),
    Failed(String),
}

impl EtcdServer {
    /// Starts a fresh single-member etcd and waits until it serves.
    pub fn start() -> Self {
        let bin = std::env::var_os("NIBBLE_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN));
        assert!(
            bin.is_file(),
            "etcd not found at {}: the etcd discovery tests need a real etcd server. Install \
             the Debian package etcd-server (`apt-get install -y etcd-server`) or point \
             NIBBLE_ETCD_BIN at an etcd binary.",
            bin.display()
        );
        let mut server = Self {
            bin,
            dir: tempfile::tempdir().expect("temporary directory"),
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        for attempt in 1..=START_ATTEMPTS {
            match server.try_spawn() {
                Ok(()) => return server,
                Err(StartError::PortTaken(log)) if attempt < START_ATTEMPTS => {
                    eprintln!("etcd lost its port to another process, retrying: {log}");
                    server.kill();
                    let _ = std::fs::remove_dir_all(server.data_dir());
                    let _ = std::fs::remove_file(server.log_path());
                    server.client_port = free_port();
                    server.peer_port = free_port();
                }
                Err(StartError::PortTaken(log) | StartError::Failed(log)) => panic!("{log}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn spawn(&mut self) {
        if let Err(StartError::PortTaken(log) | StartError::Failed(log)) = self.try_spawn() {
            panic!("{log}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), StartError> {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("etcd log file");
        let child = Command::new(&self.bin)
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--initial-cluster-state=new")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {}: {e}", self.bin.display()));
        self.child = Some(child);
        self.wait_ready()
    }

    /// Polls `/health` until etcd has a leader and answers.
    fn wait_ready(&mut self) -> Result<(), StartError> {
        let start = Instant::now();
        while start.elapsed() < READY_WAIT {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    let log = self.log_tail();
                    let message = format!("etcd exited with {status}; log:\n{log}");
                    return Err(if log.contains("address already in use") {
                        StartError::PortTaken(message)
                    } else {
                        StartError::Failed(message)
                    });
                }
            }
            if self.healthy() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(StartError::Failed(format!(
            "etcd did not become healthy within {READY_WAIT:?}; log:\n{}",
            self.log_tail()
        )))
    }

    fn healthy(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response.contains("\"health\":\"true\"")
    }

    fn log_tail(&self) -> String {
        let mut bytes = Vec::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.read_to_end(&mut bytes);
        }
        let start = bytes.len().saturating_sub(4000);
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    }

    /// Kills etcd (SIGKILL: no graceful shutdown) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills etcd and starts it again on the same ports; with `wipe`, its data is lost first
    /// (every key, lease and revision).
    pub fn restart(&mut self, wipe: bool) {
        self.kill();
        if wipe {
            std::fs::remove_dir_all(self.data_dir()).expect("remove etcd data");
        }
        self.spawn();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

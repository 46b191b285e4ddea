"""A nibble cluster as real processes on loopback, for the failover measurements of
docs/OPERATIONS.md ("Failure and recovery, measured"): etcd (Debian's etcd-server, or
$NIBBLE_ETCD_BIN), then `nibble prefill`, `nibble decode` and `nibble router`, each killed
when the cluster is closed. Standard library only.

The binary is $NIBBLE_BIN, else target/release/nibble, else target/debug/nibble; the model
$NIBBLE_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf.
"""

import json
import os
import platform
import resource
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUSTEN = ROOT / "shared/engine/tests/fixtures/austen_pride_and_prejudice_8000_20000.txt"


def binary():
    if os.environ.get("NIBBLE_BIN"):
        return os.environ["NIBBLE_BIN"]
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "nibble"
        if path.exists():
            return str(path)
    raise SystemExit("no nibble binary: cargo build --release -p nibble (or set NIBBLE_BIN)")


def model():
    return os.environ.get("NIBBLE_MODEL", str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))


def raise_fd_limit():
    """Raises this process's open-file limit to its hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def machine():
    """One line naming the machine, for the record."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPUs ({cpu}), load average {load:.1f}, {Path(binary()).parent.name} build"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One process; `address` is what it printed after `listening on`, `http` its HTTP API."""

    def __init__(self, name, args, log_dir, ready=" listening on "):
        self.name = name
        self.log = open(Path(log_dir) / f"{name}.log", "w")
        self.child = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, text=True
        )
        self.address = None
        self.http = None
        self.metrics = None
        deadline = time.time() + 180
        for line in self.child.stdout:
            if " HTTP API on http://" in line:
                self.http = line.split(" HTTP API on http://", 1)[1].strip().removesuffix("/v1")
            if " metrics on " in line:
                self.metrics = line.split(" metrics on ", 1)[1].strip()
            if ready in line:
                self.address = line.split(ready, 1)[1].strip()
                break
            if time.time() > deadline:
                break
        if self.address is None:
            raise RuntimeError(f"{name} did not start; see {self.log.name}")
        # Keep reading stdout so the process never blocks on a full pipe.
        threading.Thread(target=self.child.stdout.read, daemon=True).start()

    def kill(self):
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGKILL)
            self.child.wait()

    def alive(self):
        return self.child.poll() is None


class Cluster:
    def __init__(self, prefills=1, decodes=1, router_args=(), worker_args=()):
        self.dir = tempfile.mkdtemp(prefix="nibble-failover-")
        self.etcd_endpoint = self._start_etcd()
        self.worker_args = list(worker_args)
        self.prefills = [self.start_worker("prefill", i) for i in range(prefills)]
        self.decodes = [self.start_worker("decode", i) for i in range(decodes)]
        args = [binary(), "router", "--model", model(), "--listen", "127.0.0.1:0",
                "--etcd-endpoints", self.etcd_endpoint, "--http-listen", "127.0.0.1:0",
                "--metrics-listen", "127.0.0.1:0", *router_args]
        self.router = Proc("router", args, self.dir)
        self.wait_ready(prefills, decodes)

    def _start_etcd(self):
        client, peer = free_port(), free_port()
        url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        etcd = os.environ.get("NIBBLE_ETCD_BIN", "/usr/bin/etcd")
        self.etcd = subprocess.Popen(
            [etcd, "--name=bench", f"--data-dir={self.dir}/etcd",
             f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
             f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
             f"--initial-cluster=bench={peer_url}", "--log-level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(f"{self.dir}/etcd.log", "w"))
        for _ in range(300):
            try:
                status, _ = http("127.0.0.1", client, "GET", "/health", timeout=1)
                if status == 200:
                    return url
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def start_worker(self, role, index):
        args = [binary(), role, "--model", model(), "--listen", "127.0.0.1:0",
                "--etcd-endpoints", self.etcd_endpoint, "--threads", "1",
                "--kv-budget-mib", "64", *self.worker_args]
        return Proc(f"{role}-{index}-{time.time_ns()}", args, self.dir)

    def http_address(self):
        host, port = self.router.http.rsplit(":", 1)
        return host, int(port)

    def workers(self):
        """{role: workers the router tracks}, from its /metrics (`nibble_router_workers`)."""
        host, port = self.http_address()
        _, body = http(host, port, "GET", "/metrics", timeout=5)
        counts = {}
        for line in body.decode().splitlines():
            if line.startswith("nibble_router_workers{"):
                role = line.split('role="', 1)[1].split('"', 1)[0]
                counts[role] = int(float(line.rsplit(" ", 1)[1]))
        return counts

    def wait_ready(self, prefills, decodes, limit=60):
        """Waits until the router tracks at least the given workers of each role."""
        deadline = time.time() + limit
        while time.time() < deadline:
            try:
                counts = self.workers()
                if counts.get("prefill", 0) >= prefills and counts.get("decode", 0) >= decodes:
                    return
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router does not see {prefills} prefill and {decodes} decode workers")

    def close(self):
        for proc in [self.router, *self.prefills, *self.decodes]:
            proc.kill()
        self.etcd.kill()
        self.etcd.wait()


def http(host, port, method, path, body=None, timeout=30):
    """One HTTP/1.1 request on a new connection: (status, body bytes)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        s.sendall(head.encode() + b"\r\n" + data)
        raw = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return status, rest


def dechunk(rest):
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    return body


def complete(host, port, prompt, max_tokens=4, timeout=30):
    """A greedy completion: (ok, seconds, status or error text)."""
    start = time.perf_counter()
    try:
        status, body = http(host, port, "POST", "/v1/completions",
                            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                            timeout=timeout)
    except OSError as e:
        return False, time.perf_counter() - start, f"{type(e).__name__}: {e}"
    took = time.perf_counter() - start
    if status == 200:
        return True, took, "200"
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return False, took, f"{status} {message}"


def austen(offset, chars):
    text = AUSTEN.read_text()
    return text[offset:offset + chars]


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]

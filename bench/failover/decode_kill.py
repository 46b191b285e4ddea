#!/usr/bin/env python3
"""A decode worker killed (SIGKILL) under load: how many new requests still succeed, how fast,
and what happens to the streams in flight on it.

    python3 bench/failover/decode_kill.py [--trials 5] [--rate 10] [--window 10]

One cluster (etcd, one prefill and two decode workers, a router with its default flags); each
trial opens streams on both decode workers, kills one decode worker, and sends short greedy
completions at `--rate` per second for `--window` seconds after the kill (and, for comparison,
the same load on the healthy cluster just before); then starts the worker again and waits out the dead one's lease (10 s) before the next trial.
"""

import argparse
import json
import socket
import threading
import time

import cluster as c

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def stream(host, port, prompt, max_tokens, out):
    """A streamed completion: appends 'completed', or how it ended otherwise."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    try:
        with socket.create_connection((host, port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
    except OSError as e:
        out.append(f"transport: {e}")
        return
    text = raw.decode(errors="replace")
    if not text.startswith("HTTP/1.1 200"):
        out.append("status " + text.split("\r\n", 1)[0])
    elif '"error"' in text:
        message = text.split('"message":"', 1)[1].split('"', 1)[0] if '"message":"' in text else "?"
        out.append(f"error event: {message}")
    elif "data: [DONE]" in text:
        out.append("completed")
    else:
        out.append("cut short")


def load(host, port, args, since, results):
    """Short greedy completions at `args.rate` a second for `args.window` seconds; each result
    is (sent after `since`, ok, seconds, status)."""
    senders, i, start = [], 0, time.perf_counter()

    def one(i):
        sent = time.perf_counter() - since
        ok, took, status = c.complete(host, port, f"{PROMPT} ({i})", max_tokens=4)
        results.append((sent, ok, took, status))

    while time.perf_counter() - start < args.window:
        t = threading.Thread(target=one, args=(i,))
        t.start()
        senders.append(t)
        i += 1
        time.sleep(1 / args.rate)
    return senders


def trial(cl, victim, args):
    """Healthy load, then streams in flight, the kill and the same load again."""
    host, port = cl.http_address()
    healthy = []
    for t in load(host, port, args, time.perf_counter(), healthy):
        t.join()
    # Streams in flight on both decode workers (the router spreads them).
    streams, threads = [], []
    for i in range(args.streams):
        t = threading.Thread(target=stream, args=(host, port, f"{PROMPT} {i}", 64, streams))
        t.start()
        threads.append(t)
    time.sleep(1.0)
    results = []
    cl.decodes[victim].kill()
    senders = load(host, port, args, time.perf_counter(), results)
    for t in threads + senders:
        t.join()
    cl.decodes[victim] = cl.start_worker("decode", victim)
    time.sleep(12)  # the killed worker's lease (10 s) runs out
    cl.wait_ready(1, 2)
    return healthy, results, streams


def summary(name, results):
    ok = [r for r in results if r[1]]
    fast = [r for r in ok if r[2] <= 1.0]
    first = [r for r in results if r[0] < 1.0]
    latencies = [r[2] for r in ok]
    failures = {}
    for _, good, _, status in results:
        if not good:
            failures[status] = failures.get(status, 0) + 1
    print(f"{name}: {len(results)} requests")
    print(f"  succeeded: {len(ok)} ({100 * len(ok) / len(results):.1f}%), "
          f"within 1 s: {len(fast)} ({100 * len(fast) / len(results):.1f}%)")
    print(f"  sent in the first second: {len(first)}, succeeded {sum(r[1] for r in first)}")
    print(f"  latency of successes p50 {c.percentile(latencies, 50):.3f} s, "
          f"p99 {c.percentile(latencies, 99):.3f} s, max {max(latencies, default=0):.3f} s")
    print(f"  failures: {failures}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rate", type=float, default=4.0, help="new requests per second")
    parser.add_argument("--window", type=float, default=10.0, help="seconds after the kill")
    parser.add_argument("--streams", type=int, default=4, help="streams in flight at the kill")
    args = parser.parse_args()
    c.raise_fd_limit()
    cl = c.Cluster(prefills=1, decodes=2)
    try:
        host, port = cl.http_address()
        for _ in range(3):
            c.complete(host, port, PROMPT)
        healthy, results, streams = [], [], []
        for n in range(args.trials):
            h, r, s = trial(cl, n % 2, args)
            healthy += h
            results += r
            streams += s
            print(f"trial {n}: {sum(ok for _, ok, _, _ in r)}/{len(r)} succeeded; streams {s}")
    finally:
        cl.close()
    print(f"machine: {c.machine()}")
    summary("healthy, before each kill", healthy)
    summary("new requests after the kill", results)
    ends = {}
    for s in streams:
        ends[s.split(" (request")[0]] = ends.get(s.split(" (request")[0], 0) + 1
    print(f"streams in flight at the kill: {len(streams)}: {ends}")


if __name__ == "__main__":
    main()

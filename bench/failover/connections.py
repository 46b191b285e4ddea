#!/usr/bin/env python3
"""Idle and slow connections held open against the router's HTTP port while `/health` and a
real completion are timed.

    python3 bench/failover/connections.py [--connections 20000] [--max-connections N]
        [--completion-tokens 4]

A router (`--http-max-connections N` when given, else its default) with one decode worker.
Helper processes open `--connections` connections, half idle (connected, nothing sent) and
half slow (a request's headers begun, then one more header byte every `--trickle` seconds).
Once they are open, `/health` (each on a new connection) and short greedy completions are
timed. With `--past-idle` the script then waits past the router's idle timeout
(`--idle-timeout`, passed to the router) and counts which connections the router closed. The process's open-file limit is
raised to its hard limit first. At its cap the router closes the connection idle longest for a
new one (a connection refused because every one under the cap is being answered gets 503), and
it closes a slow connection whose headers take longer than its header timeout (10 s).
"""

import argparse
import multiprocessing as mp
import select
import socket
import time

import cluster as c

PER_PROCESS = 9000  # under the usual hard open-file limit of a process


def holder(host, port, count, trickle, commands, reports):
    """Opens `count` connections (even: idle, odd: slow) and reports how many stay open."""
    c.raise_fd_limit()
    socks = []
    failed = 0
    for i in range(count):
        try:
            s = socket.create_connection((host, port), timeout=10)
            s.setblocking(False)
            if i % 2:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append((i % 2 == 1, s))
        except OSError:
            failed += 1
    reports.put(("opened", len(socks), failed))
    last_trickle = time.time()
    while True:
        if not commands.empty():
            command = commands.get()
            if command == "stop":
                break
            if command == "count":
                # Readable: the router closed it, or refused it (a 503, then closed).
                poll = select.poll()
                for _, s in socks:
                    poll.register(s, select.POLLIN)
                closed = {fd for fd, _ in poll.poll(0)}
                open_slow = sum(1 for slow, s in socks if slow and s.fileno() not in closed)
                open_idle = sum(1 for slow, s in socks if not slow and s.fileno() not in closed)
                reports.put(("open", open_idle, open_slow))
        if time.time() - last_trickle >= trickle:
            for slow, s in socks:
                if slow:
                    try:
                        s.send(b"X")
                    except OSError:
                        pass
            last_trickle = time.time()
        time.sleep(0.2)
    for _, s in socks:
        s.close()


def count_open(procs):
    idle = slow = 0
    for commands, reports, _ in procs:
        commands.put("count")
    for _, reports, _ in procs:
        _, i, s = reports.get()
        idle += i
        slow += s
    return idle, slow


def timed(fn, n):
    times, statuses = [], {}
    for _ in range(n):
        start = time.perf_counter()
        try:
            status = fn()
        except OSError as e:
            status = type(e).__name__
        times.append(time.perf_counter() - start)
        statuses[status] = statuses.get(status, 0) + 1
    return times, statuses


def report(name, times, statuses):
    print(f"  {name}: p50 {1000 * c.percentile(times, 50):.1f} ms, "
          f"p99 {1000 * c.percentile(times, 99):.1f} ms, max {1000 * max(times):.1f} ms; {statuses}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=20000)
    parser.add_argument("--max-connections", type=int, help="the router's --http-max-connections")
    parser.add_argument("--idle-timeout", type=int, default=60, help="--http-idle-timeout-secs")
    parser.add_argument("--past-idle", action="store_true",
                        help="then wait past the idle timeout and count what the router closed")
    parser.add_argument("--trickle", type=float, default=10.0, help="seconds between slow bytes")
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--completion-tokens", type=int, default=4,
                        help="max_tokens of each timed completion")
    args = parser.parse_args()
    hard = c.raise_fd_limit()
    router_args = ["--http-idle-timeout-secs", str(args.idle_timeout)]
    if args.max_connections:
        router_args += ["--http-max-connections", str(args.max_connections)]
    cl = c.Cluster(prefills=0, decodes=1, router_args=router_args)
    procs = []
    try:
        host, port = cl.http_address()
        print(f"machine: {c.machine()}; open-file limit {hard}; router {' '.join(router_args)}")
        health = lambda: c.http(host, port, "GET", "/health", timeout=10)[0]
        tokens = args.completion_tokens
        real = lambda: c.complete(host, port, "The capital of France is", tokens, timeout=30)[2].split(" ")[0]
        print("without the connections:")
        report("/health", *timed(health, args.probes))
        report("completion", *timed(real, args.requests))
        left = args.connections
        start = time.time()
        while left > 0:
            n = min(PER_PROCESS, left)
            commands, reports = mp.Queue(), mp.Queue()
            p = mp.Process(target=holder, args=(host, port, n, args.trickle, commands, reports))
            p.start()
            procs.append((commands, reports, p))
            left -= n
        opened = failed = 0
        for _, reports, _ in procs:
            _, o, f = reports.get()
            opened += o
            failed += f
        print(f"{opened} connections opened in {time.time() - start:.1f} s ({failed} failed to connect)")
        time.sleep(2)
        idle, slow = count_open(procs)
        print(f"held open by the router: {idle} idle, {slow} slow")
        print("with them open:")
        report("/health", *timed(health, args.probes))
        report("completion", *timed(real, args.requests))
        if not args.past_idle:
            return
        wait = args.idle_timeout + 15 - (time.time() - start)
        if wait > 0:
            print(f"waiting {wait:.0f} s, past the idle timeout ({args.idle_timeout} s)...")
            time.sleep(wait)
        idle, slow = count_open(procs)
        print(f"after {time.time() - start:.0f} s: {idle} idle and {slow} slow still open")
        report("/health", *timed(health, args.probes))
    finally:
        for commands, _, p in procs:
            commands.put("stop")
        for _, _, p in procs:
            p.join(timeout=30)
        cl.close()


if __name__ == "__main__":
    main()

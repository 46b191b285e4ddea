#!/usr/bin/env python3
"""A prefill worker killed (SIGKILL) while it prefills a long prompt: how soon long prompts are
served again, with another prefill worker left and with none (the decode worker prefills).

    python3 bench/failover/prefill_kill.py [--trials 3] [--chars 2800]

For each layout (two prefill workers and one decode worker; one and one) and trial: a long
prompt (over the router's local-prefill threshold of 512 tokens) is sent, the prefill worker
computing it is killed as soon as its metrics show it running, and a second long prompt is sent
at that moment. Each one's latency is compared with the same two prompts sent together on the
healthy cluster: the difference is what the failure cost it. Each prompt starts with its own
number, so no prefix is ever cached. The killed worker is started again between trials.
"""

import argparse
import threading
import time

import cluster as c

class Prompts:
    """Long prompts, each starting with its own number, so no two share a cached prefix."""

    def __init__(self, chars):
        self.text, self.next = c.austen(0, chars), 0

    def take(self):
        self.next += 1
        return f"Passage {self.next}. {self.text}"


def busy_prefill(cl):
    """The prefill worker computing a prompt now (its running gauge), if any."""
    for proc in cl.prefills:
        if proc.metrics is None or not proc.alive():
            continue
        h, p = proc.metrics.rsplit(":", 1)
        _, body = c.http(h, int(p), "GET", "/metrics", timeout=5)
        for line in body.decode().splitlines():
            if line.startswith("nibble_worker_running_requests{") and not line.endswith(" 0"):
                return proc
    return None


def pair(host, port, prompts, delay_second=0.0, before_second=None):
    """Two long prompts, the second `delay_second` after the first (`before_second` runs in
    between): their (ok, seconds, status)."""
    results = [None, None]

    def send(i):
        results[i] = c.complete(host, port, prompts.take(), max_tokens=2, timeout=180)

    first = threading.Thread(target=send, args=(0,))
    first.start()
    if before_second is not None:
        before_second()
    time.sleep(delay_second)
    send(1)
    first.join()
    return results


def trial(cl, prompts):
    """The first prompt's prefill worker is killed while it computes it; the second prompt is
    sent at that moment."""
    host, port = cl.http_address()
    killed = []

    def kill_its_prefill_worker():
        deadline = time.time() + 30
        while time.time() < deadline:
            victim = busy_prefill(cl)
            if victim is not None:
                victim.kill()
                killed.append(cl.prefills.index(victim))
                return
            time.sleep(0.02)
        raise RuntimeError("no prefill worker picked the prompt up")

    results = pair(host, port, prompts, before_second=kill_its_prefill_worker)
    index = killed[0]
    cl.prefills[index] = cl.start_worker("prefill", index)
    time.sleep(12)  # the killed worker's lease (10 s) runs out
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--chars", type=int, default=2800, help="prompt length (~4 chars a token)")
    args = parser.parse_args()
    prompts = Prompts(args.chars)
    print(f"machine: {c.machine()}")
    for prefills in (2, 1):
        cl = c.Cluster(prefills=prefills, decodes=1)
        try:
            host, port = cl.http_address()
            c.complete(host, port, prompts.take(), max_tokens=2, timeout=180)
            healthy = [pair(host, port, prompts) for _ in range(3)]
            assert all(ok for p in healthy for ok, _, _ in p), healthy
            base = [sorted(p[i][1] for p in healthy)[1] for i in (0, 1)]
            print(f"{prefills} prefill worker(s), 1 decode worker: two long prompts sent together "
                  f"take {base[0]:.2f} s and {base[1]:.2f} s healthy (median of 3)")
            for n in range(args.trials):
                for label, (ok, took, status), b in zip(("in flight", "sent at the kill"),
                                                         trial(cl, prompts), base):
                    print(f"  trial {n} {label:>16}: {'ok' if ok else 'FAILED'} in {took:.2f} s "
                          f"({took - b:+.2f} s over healthy) {'' if ok else status}")
        finally:
            cl.close()


if __name__ == "__main__":
    main()

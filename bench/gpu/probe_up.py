"""Drives a running `nibble up` over its OpenAI HTTP API: one long prompt (prefill worker + page
transfer), then 16 concurrent requests; prints what came back and the timings."""
import json, sys, time, urllib.request, concurrent.futures as cf

URL = "http://127.0.0.1:8000/v1/completions"


def ask(prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(URL, body, {"Content-Type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    return time.time() - t, out


long_prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
dt, out = ask(long_prompt, 64)
print("long", round(dt, 3), json.dumps(out["usage"]), repr(out["choices"][0]["text"][:80]))
t = time.time()
with cf.ThreadPoolExecutor(16) as ex:
    res = list(ex.map(lambda i: ask(f"Story {i}: once upon a time", 128), range(16)))
wall = time.time() - t
toks = sum(o["usage"]["completion_tokens"] for _, o in res)
print("concurrent16", round(wall, 3), "s", toks, "tokens", round(toks / wall, 1), "tok/s")

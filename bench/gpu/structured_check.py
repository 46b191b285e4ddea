#!/usr/bin/env python3
"""Structured outputs and a tool call against a running `nibble up` (on the GPU machine, whose
model may be a truncated test model that writes nonsense: the grammar must still make it parse).

    python3 bench/gpu/structured_check.py [BASE_URL]     # default http://127.0.0.1:8000/v1

Prints one JSON line per check and "all checks passed"; exits non-zero on the first failure.
Standard library only (the GPU machine has no internet).
"""

import json
import sys
import time
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def post(path, body):
    request = urllib.request.Request(
        BASE + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    started = time.time()
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response), time.time() - started


def report(what, ok, **detail):
    print(json.dumps({"check": what, "ok": ok, **detail}))
    if not ok:
        sys.exit(1)


def main():
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0, 0.8):
        body = {"messages": messages, "max_tokens": 120, "temperature": temperature, "seed": 5,
                "response_format": fmt}
        answer, seconds = post("/chat/completions", body)
        text = answer["choices"][0]["message"]["content"]
        person = json.loads(text)
        ok = (set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
              and person["city"] in PERSON["properties"]["city"]["enum"])
        report(f"json_schema at temperature {temperature}", ok, text=text, seconds=round(seconds, 3),
               usage=answer["usage"])
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [tool],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
            "temperature": 0}
    answer, seconds = post("/chat/completions", body)
    choice = answer["choices"][0]
    call = choice["message"]["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    report("required tool call", choice["finish_reason"] == "tool_calls" and isinstance(args["city"], str),
           call=call, seconds=round(seconds, 3))
    print("all checks passed")


if __name__ == "__main__":
    main()

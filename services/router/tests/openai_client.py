#!/usr/bin/env python3
"""Drives nibble's OpenAI-compatible HTTP API with the official `openai` client.

    python3 openai_client.py BASE_URL MODEL API_KEY

BASE_URL ends in /v1. Exits 0 and prints "all checks passed" when every check holds; any failed
check, a missing `openai` package or an unreachable server exits non-zero. Run by the Rust test
`the_openai_python_client_works_against_the_api` (services/router/tests/http.rs) against an
in-process cluster.
"""

import sys

try:
    import openai
except ImportError as e:  # Fail, never skip: scripts/deps.sh installs the package.
    sys.exit(f"the openai package is missing ({e}); run scripts/deps.sh")


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


def main():
    base_url, model, api_key = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)

    models = client.models.list()
    check([m.id for m in models.data] == [model], f"models.list gives {model}")

    # Completions, greedy: twice the same text.
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    text = first.choices[0].text
    check(text and text == second.choices[0].text, f"greedy completion is repeatable: {text!r}")
    check(first.choices[0].finish_reason in ("length", "stop"), "completion finish_reason")
    check(first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 0, "completion usage")
    check(
        first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens,
        "total_tokens adds up",
    )

    # Streamed completion with usage: the same text, then a usage chunk.
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == text, "streamed completion = non-streamed")
    check(chunks[-1].usage is not None and not chunks[-1].choices, "a final usage chunk")
    check(chunks[-1].usage.completion_tokens == first.usage.completion_tokens, "streamed usage")

    # Chat, non-streamed and streamed.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, seed=7, logprobs=True
    )
    answer = chat.choices[0].message.content
    check(chat.choices[0].message.role == "assistant" and answer, f"chat answers: {answer!r}")
    check(len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens, "chat logprobs")
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    check("".join(pieces) == answer, "streamed chat = non-streamed")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, "chat usage")

    # Top alternatives: logprobs=3 on completions, top_logprobs=3 on chat (greedy, so the chosen
    # token is the most likely one).
    completion = client.completions.create(**kwargs, logprobs=3)
    lp = completion.choices[0].logprobs
    n = completion.usage.completion_tokens
    check(
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n,
        "completion logprobs: one entry per token",
    )
    steps = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    check(
        all(3 <= len(top) <= 4 and top.get(token) == value for token, value, top in steps),
        f"3 alternatives and the chosen token per position: {lp.top_logprobs[0]}",
    )
    check(
        all(v <= value <= 0 for _, value, top in steps for v in top.values()),
        "the chosen token is the most likely",
    )
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    check(len(content) == chat.usage.completion_tokens, "chat top_logprobs: one entry per token")
    check(
        all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content),
        f"3 alternatives, the chosen token first: {content[0].top_logprobs}",
    )
    values = [[t.logprob for t in e.top_logprobs] for e in content]
    check(
        all(v == sorted(v, reverse=True) and v[0] <= 0 for v in values),
        "alternatives sorted by logprob, all <= 0",
    )
    check(
        all(bytes(t.bytes) == t.token.encode() for e in content for t in e.top_logprobs),
        "alternatives' bytes are their text's UTF-8",
    )
    try:
        client.chat.completions.create(
            model=model, messages=messages, logprobs=True, top_logprobs=21
        )
        check(False, "top_logprobs=21 refused")
    except openai.BadRequestError as e:
        check((e.body or {}).get("param") == "top_logprobs", "top_logprobs=21 is a 400")

    # Sampling with a seed is repeatable.
    sampled = [
        client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=8, temperature=0.8, top_p=0.9, seed=42
        ).choices[0].text
        for _ in range(2)
    ]
    check(sampled[0] == sampled[1], "a seed makes sampling repeatable")

    # Errors arrive as the client's exception types.
    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, n=2)
        check(False, "n=2 refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and (e.body or {}).get("param") == "n", "n=2 is a 400 naming n")
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check(False, "unknown model refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "an unknown model is a 404")
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
    try:
        wrong.models.list()
        check(False, "wrong key refused")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "a wrong key is a 401")

    print("all checks passed")


if __name__ == "__main__":
    main()

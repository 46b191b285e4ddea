#!/usr/bin/env python3
"""Drives nibble's OpenAI-compatible HTTP API with the official `openai` client.

    python3 openai_client.py BASE_URL MODEL API_KEY

BASE_URL ends in /v1. Exits 0 and prints "all checks passed" when every check holds; any failed
check, a missing `openai` package or an unreachable server exits non-zero. Run by the Rust test
`the_openai_python_client_works_against_the_api` (services/router/tests/http.rs) against an
in-process cluster.
"""

import json
import sys
import urllib.request

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

    common_parameters(client, base_url, model, api_key)

    # Errors arrive as the client's exception types.
    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, n=17)
        check(False, "n=17 refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and (e.body or {}).get("param") == "n", "n=17 is a 400 naming n")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=0)
        check(False, "max_tokens=0 without echo refused")
    except openai.BadRequestError as e:
        check((e.body or {}).get("param") == "max_tokens", "max_tokens=0 needs echo")
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


def tokenize(base_url, api_key, text):
    """Token ids of `text` (no special tokens) through the router's vLLM-style /tokenize."""
    root = base_url.rsplit("/v1", 1)[0]
    body = json.dumps({"prompt": text, "add_special_tokens": False}).encode()
    request = urllib.request.Request(
        f"{root}/tokenize",
        data=body,
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["tokens"]


def common_parameters(client, base_url, model, api_key):
    """Penalties, logit_bias, n, best_of, echo with max_tokens 0, prompt lists, usage."""
    prompt = "The capital of France is"
    greedy = dict(model=model, prompt=prompt, max_tokens=24, temperature=0)
    plain = client.completions.create(**greedy).choices[0].text
    for name in ("presence_penalty", "frequency_penalty"):
        penalized = client.completions.create(**greedy, **{name: 2.0}).choices[0].text
        check(penalized != plain, f"{name}=2 changes the greedy text: {penalized!r}")

    banana = tokenize(base_url, api_key, " banana")[0]
    forced = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(banana): 100}
    )
    check(forced.choices[0].text == " banana" * 3, f"logit_bias +100 forces a token: {forced.choices[0].text!r}")
    paris = tokenize(base_url, api_key, " Paris")[0]
    check(plain.startswith(" Paris"), f"the greedy answer starts with Paris: {plain!r}")
    banned = client.completions.create(**greedy, logit_bias={str(paris): -100}).choices[0].text
    check(" Paris" not in banned, f"logit_bias -100 bans a token: {banned!r}")

    three = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=3
    )
    check([c.index for c in three.choices] == [0, 1, 2], "n=3 gives 3 choices")
    one = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3)
    check(len({c.text for c in three.choices}) > 1, "the choices are sampled with their own seeds")
    check(three.usage.prompt_tokens == one.usage.prompt_tokens
          and 3 <= three.usage.completion_tokens <= 18,
          "n=3 counts the prompt once and every choice's tokens")
    best = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=1, best_of=3,
    )
    check(len(best.choices) == 1 and best.choices[0].index == 0, "best_of=3, n=1 gives 1 choice")
    ranked = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=2, best_of=3,
        logprobs=0,
    )
    sums = [sum(c.logprobs.token_logprobs) for c in ranked.choices]
    check(len(sums) == 2 and sums[0] >= sums[1], f"best_of ranks by cumulative logprob: {sums}")

    # lm-eval's loglikelihood request: echo, max_tokens 0, logprobs.
    ids = tokenize(base_url, api_key, prompt)
    generated = client.completions.create(
        model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=0
    ).choices[0]
    token = generated.logprobs.tokens[0]
    next_id = tokenize(base_url, api_key, token)
    scored = client.completions.create(
        model=model, prompt=ids + next_id, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = scored.choices[0].logprobs
    check(scored.choices[0].text == prompt + token, f"echo returns the prompt: {scored.choices[0].text!r}")
    check(len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None,
          "echo logprobs cover the prompt, the first token's null")
    check(all(v <= 0 for v in lp.token_logprobs[1:]) and lp.top_logprobs[0] is None,
          "prompt logprobs are log-probabilities")
    check(abs(lp.token_logprobs[-1] - generated.logprobs.token_logprobs[0]) < 0.02,
          f"the scored token's logprob is the generated one's: {lp.token_logprobs[-1]} vs "
          f"{generated.logprobs.token_logprobs[0]}")
    check(scored.usage.completion_tokens == 0, "scoring generates nothing")

    prompts = [prompt, "Once upon a time"]
    listed = client.completions.create(
        model=model, prompt=prompts, max_tokens=5, temperature=0, echo=True
    )
    check([c.index for c in listed.choices] == [0, 1], "a list of 2 prompts gives 2 choices")
    check(all(c.text.startswith(p) and len(c.text) > len(p) for c, p in zip(listed.choices, prompts)),
          "each listed prompt's choice completes it (echo shows which)")

    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [chunk.usage.completion_tokens for chunk in stream]
    check(counts == sorted(counts) and counts[-1] == 5 and len(counts) > 2,
          f"continuous_usage_stats: every chunk carries the usage so far: {counts}")


if __name__ == "__main__":
    main()

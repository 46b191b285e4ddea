#!/usr/bin/env python3
"""Structured outputs and tool calling through nibble's HTTP API with the official `openai` client.

    python3 openai_structured.py BASE_URL MODEL [API_KEY]

BASE_URL ends in /v1. JSON outputs are validated against their schemas with the `jsonschema`
package; tool calls are round-tripped through a two-turn conversation. Exits 0 and prints "all
checks passed" when every check holds; any failed check, a missing package or an unreachable
server exits non-zero. Run by the Rust tests `the_openai_client_gets_structured_outputs_and_tool_calls`
(services/router/tests/structured.rs, an in-process cluster) and
`the_openai_client_scripts_pass_against_nibble_up` (services/nibble/tests/up_openai.rs, the real
`nibble up`).
"""

import json
import sys

try:
    import jsonschema
    import openai
    import pydantic
except ImportError as e:  # Fail, never skip: scripts/deps.sh installs both.
    sys.exit(f"a Python package is missing ({e}); run scripts/deps.sh")


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def main():
    base_url, model = sys.argv[1:3]
    api_key = sys.argv[3] if len(sys.argv) > 3 else "none"
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe a French programmer as JSON."}]

    # json_schema, non-streamed and streamed: both valid instances, the same text (greedy).
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=0, response_format=response_format
    )
    text = chat.choices[0].message.content
    person = json.loads(text)
    jsonschema.validate(person, PERSON)
    check(True, f"json_schema output is a valid instance: {text}")
    check(chat.choices[0].finish_reason == "stop", "it ends by itself")
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=120,
        temperature=0,
        response_format=response_format,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(streamed == text, "streamed json_schema output = non-streamed")

    # The client's own structured-output helper: a pydantic model as the schema (strict).
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int
        languages: list[str] = pydantic.Field(max_length=3)

    parsed = client.chat.completions.parse(
        model=model, messages=messages, max_tokens=200, temperature=0, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    check(isinstance(person, Person), f"chat.completions.parse gives a Person: {person!r}")

    # json_object, on chat and (vLLM's extension) on completions. Any JSON object is allowed,
    # so the prompt asks for a small one: a free description can repeat itself past max_tokens.
    chat = client.chat.completions.create(
        model=model,
        messages=[{
            "role": "user",
            "content": "Return a JSON object with the keys name and age for a French programmer.",
        }],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    check(chat.choices[0].finish_reason == "stop", "the json_object answer ends by itself")
    check(isinstance(json.loads(chat.choices[0].message.content), dict), "json_object is an object")
    completion = client.completions.create(
        model=model, prompt="A date:", max_tokens=12, temperature=0,
        extra_body={"guided_regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    date = completion.choices[0].text
    check(len(date) == 11 and date[5] == "-" and date[8] == "-", f"guided_regex on completions: {date!r}")

    # An invalid schema is a 400 naming response_format.
    try:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "object", "required": 3}}},
        )
        check(False, "an invalid schema is refused")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "response_format", f"an invalid schema is a 400: {e.body['message']}")

    # Tool calling: a required call, its result, and the answer.
    question = [{"role": "user", "content": "What is the weather like in Lyon?"}]
    first = client.chat.completions.create(
        model=model, messages=question, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0,
    )
    choice = first.choices[0]
    check(choice.finish_reason == "tool_calls", f"required gives tool_calls: {choice}")
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    check(call.function.name == "get_weather", f"the call's arguments are valid: {arguments}")
    second = client.chat.completions.create(
        model=model,
        messages=question
        + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "sunny, 21 C"})},
        ],
        tools=[WEATHER],
        max_tokens=30,
        temperature=0,
    )
    answer = second.choices[0].message
    check(answer.content and not answer.tool_calls, f"the second turn answers in text: {answer.content!r}")

    # Streamed, named: the call arrives in tool_calls deltas the client assembles.
    stream = client.chat.completions.create(
        model=model, messages=question, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0, stream=True,
    )
    names, args, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                names.append(delta.function.name or "")
                args.append(delta.function.arguments or "")
            finish = c.finish_reason or finish
    check("".join(names) == "get_weather" and finish == "tool_calls", "streamed named call")
    jsonschema.validate(json.loads("".join(args)), WEATHER["function"]["parameters"])

    print("all checks passed")


if __name__ == "__main__":
    main()

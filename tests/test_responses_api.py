"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through the
official openai SDK against a real `appliance up` with the tiny random model. References: the
same conversation through chat completions (greedy text, /tokenize's prompt length), the
SDK's own stream assembly (`responses.stream`), jsonschema and pydantic for structured and
tool-call output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import ServerProcess, write_template

from appliance.server.response_store import ResponseStore, StoredResponse
from appliance.server.responses_schema import ResponseObject

MODEL = "tiny"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER_PARAMS,
}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    active: bool


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-responses")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_len(server: ServerProcess, messages: list[dict[str, Any]]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_plain_response_is_the_chat_answer(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    resp = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0.0,
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0
    )
    assert resp.object == "response" and resp.id.startswith("resp")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    # The random model rarely ends in 12 tokens: cut by max_output_tokens, said as OpenAI does.
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete"
        assert resp.incomplete_details and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"
    assert resp.usage is not None
    assert resp.usage.input_tokens == _prompt_len(server, messages)
    assert resp.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_stream_events_arrive_in_order_and_assemble(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model=MODEL, input="Tell me a story.", max_output_tokens=24, temperature=0.0
    )
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # streamed in pieces, not at the end
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert events[-4].text == whole.output_text  # type: ignore[union-attr]
    # The SDK's own accumulation of the events gives the same response.
    with client.responses.stream(**args) as stream:
        assembled = stream.get_final_response()
    assert assembled.output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_format_gives_valid_objects(client: openai.OpenAI, stream: bool) -> None:
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    for seed in range(4):
        args: dict[str, Any] = dict(
            model=MODEL,
            input="A person.",
            text={"format": fmt},
            temperature=1.0,
            extra_body={"seed": seed},  # vLLM's extra: reproducible samples
            max_output_tokens=100,
        )
        if stream:
            events = list(client.responses.create(stream=True, **args))
            resp = events[-1].response  # type: ignore[union-attr]
        else:
            resp = client.responses.create(**args)
        assert resp.status == "completed", resp.output_text
        jsonschema.validate(json.loads(resp.output_text), schema)
    parsed = client.responses.parse(
        model=MODEL, input="A person.", text_format=Person, max_output_tokens=100
    )
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_then_continue_with_its_output(
    server: ServerProcess, client: openai.OpenAI, stream: bool
) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        instructions="Call the tool.",  # not carried into the continuation (OpenAI's rule)
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=1.0,
        extra_body={"seed": 3},
        max_output_tokens=60,
    )
    if stream:
        events = list(client.responses.create(stream=True, **args))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert kinds.index("response.output_item.added") < kinds.index(
            "response.function_call_arguments.done"
        )
        first = events[-1].response  # type: ignore[union-attr]
    else:
        first = client.responses.create(**args)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    # Continue: the stored conversation plus the tool's output is the prompt.
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=8,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id and second.output_text
    call = {
        "id": calls[0].call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": calls[0].arguments},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == _prompt_len(server, messages)


def test_required_tool_choice_streams_the_calls_it_answers(client: openai.OpenAI) -> None:
    # The tiny model's template has no tool format: `required` takes the generic format,
    # whose calls are parsed whole at the finish; streamed or not, the same seeded sample.
    args: dict[str, Any] = dict(
        model=MODEL,
        input="Weather in two cities?",
        tools=[WEATHER, {**WEATHER, "name": "get_time", "description": "Local time"}],
        tool_choice="required",
        temperature=1.0,
        extra_body={"seed": 11},
        max_output_tokens=120,
    )
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    streamed = events[-1].response  # type: ignore[union-attr]
    calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert calls and calls == [
        (i.name, i.arguments) for i in streamed.output if i.type == "function_call"
    ]
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == [i.type for i in streamed.output]
    # Each call's arguments arrive as deltas that add up to the done event's arguments.
    for e in events:
        if e.type == "response.function_call_arguments.done":
            deltas = [
                d.delta
                for d in events
                if d.type == "response.function_call_arguments.delta" and d.item_id == e.item_id
            ]
            assert "".join(deltas) == e.arguments


def test_stored_responses_get_delete_and_404s(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert client.responses.delete(resp.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(resp.id)
    assert exc.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=resp.id)
    assert exc.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert resp.id in exc.value.body["message"]  # type: ignore[index]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "not": {}}}]},
            "tools[0].parameters",
        ),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": "hi", "priority": "nonesuch"}, "priority"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_store_keeps_the_newest_within_its_bound() -> None:
    store = ResponseStore()
    for i in range(5):
        resp = ResponseObject(id=f"r{i}", created_at=0, model="m", status="completed")
        store.put(StoredResponse(resp, []), capacity=3)
    assert len(store) == 3
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put(StoredResponse(ResponseObject(id="x", created_at=0, model="m", status="c"), []), 0)
    assert len(store) == 0  # capacity 0: nothing is kept

"""Tool calls on every model: the parser comes from the chat template when it has a tool
format of its own (tests/templates), and any other template gets the generic JSON format
under the grammar. Over HTTP through the official openai SDK on the random-weight tiny model
(ChatML-like template, no tool format): `tools` without `tool_choice` answers in OpenAI's
shape (calls valid against their schemas by jsonschema, or the plain answer's text, never the
JSON wrapper), streamed like it is answered whole; a follow-up with the assistant's calls and
a tool result is taken; `required` always calls; a schema the grammar cannot enforce is a 400
naming the tool and the keyword. A template that raises on a system message gets the tool
description in the first user turn."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_harness import ServerProcess, write_template
from transformers import AutoTokenizer

from appliance.models.demo_model import CHAT_TEMPLATE
from appliance.server.chat_caps import _probe, detect_parser
from appliance.server.prompts import chat_prompt
from appliance.server.schemas import ChatCompletionRequest, ChatMessage
from appliance.server.tool_calls import ToolPlan, ToolStream, plan_tools
from appliance.server.tool_generic import parse_generic

TEMPLATES = Path(__file__).parent / "templates"
MODEL = "tiny"
# SmolLM2-135M-Instruct's template (ChatML, a default system turn): no tool format.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# -- which format, from the template --------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "parser"),
    [
        ("qwen2.5_hermes.jinja", "hermes"),
        ("llama3.1_json.jinja", "llama3_json"),
        ("mistral_v0.3.jinja", "mistral"),
        ("no_system_role.jinja", ""),
    ],
)
def test_the_parser_is_detected_from_the_template(name: str, parser: str) -> None:
    assert detect_parser((TEMPLATES / name).read_text()) == parser


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, CHAT_TEMPLATE, None])
def test_chatml_templates_take_the_generic_format(template: str | None) -> None:
    assert detect_parser(template) == ""
    plan = plan_tools(ChatCompletionRequest(messages=[], tools=TOOLS), "", template)
    assert plan is not None and plan.mode == "generic" and plan.structured is not None
    assert plan.template_tools is None and "get_weather" in plan.preamble


def test_a_template_format_is_used_and_a_configured_parser_wins() -> None:
    hermes = (TEMPLATES / "qwen2.5_hermes.jinja").read_text()
    body = ChatCompletionRequest(messages=[], tools=TOOLS)  # no tool_choice: auto
    plan = plan_tools(body, "", hermes)
    assert plan is not None and (plan.mode, plan.parser, plan.structured) == (
        "auto",
        "hermes",
        None,
    )
    plan = plan_tools(body, "llama3_json", hermes)
    assert plan is not None and plan.parser == "llama3_json"


def test_a_named_choice_is_described_where_the_template_has_no_tool_format() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    body = ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice=named)
    plan = plan_tools(body, "", SMOLLM2_TEMPLATE)
    assert plan is not None and plan.mode == "named" and plan.template_tools is None
    assert "get_time" in plan.preamble and "get_weather" not in plan.preamble
    plan = plan_tools(body, "", (TEMPLATES / "qwen2.5_hermes.jinja").read_text())
    assert plan is not None and plan.preamble == "" and plan.template_tools == TOOLS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_template_capabilities_are_probed(tokenizer: Any) -> None:
    chatml = _probe(tokenizer, SMOLLM2_TEMPLATE)
    # ChatML writes any role's name: "tool" is no role of its own there, and calls are dropped.
    assert (chatml.system, chatml.tool_calls, chatml.tool_role) == (True, False, False)
    gemma = _probe(tokenizer, (TEMPLATES / "no_system_role.jinja").read_text())
    assert (gemma.system, gemma.tool_calls, gemma.tool_role) == (False, False, False)
    for name in ("qwen2.5_hermes.jinja", "llama3.1_json.jinja", "mistral_v0.3.jinja"):
        caps = _probe(tokenizer, (TEMPLATES / name).read_text())
        assert (caps.system, caps.tool_calls, caps.tool_role) == (True, True, True), name


def _prompt(tokenizer: Any, template: str, messages: list[dict[str, Any]], **body: Any) -> str:
    tokenizer.chat_template = template
    msgs = [ChatMessage(**m) for m in messages]
    plan = plan_tools(ChatCompletionRequest(messages=msgs, tools=TOOLS, **body), "", template)
    ids = chat_prompt(SimpleNamespace(tokenizer=tokenizer), msgs, True, plan)  # type: ignore[arg-type]
    return tokenizer.decode(ids)


CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
}
FOLLOW_UP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "rain, 4 C"},
]


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn(
    tokenizer: Any,
) -> None:
    template = (TEMPLATES / "no_system_role.jinja").read_text()
    text = _prompt(
        tokenizer,
        template,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
    )
    turns = text.split("<start_of_turn>")
    first_user = next(t for t in turns if t.startswith("user\n"))
    for needle in (
        "Be brief.",
        "get_weather",
        "get_time",
        "Weather in a city",
        '"response"',
        '"enum": ["Paris", "Oslo", "Lima"]',
        "Weather?",
    ):
        assert needle in first_user, (needle, text)
    assert first_user.index("get_weather") < first_user.index("Weather?")
    # A conversation with calls and a tool result renders too, alternating user/model turns.
    text = _prompt(tokenizer, template, FOLLOW_UP)
    roles = [t.split("\n", 1)[0] for t in text.split("<start_of_turn>")[1:]]
    assert roles == ["user", "model", "user", "model"], text
    assert '"get_weather"' in text and "rain, 4 C" in text and "call00001" in text


def test_chatml_renders_the_calls_and_results_in_the_generic_format(tokenizer: Any) -> None:
    text = _prompt(tokenizer, SMOLLM2_TEMPLATE, FOLLOW_UP, parallel_tool_calls=False)
    assert text.startswith("<|im_start|>system\nYou can use these tools")
    assert "SmolLM" not in text  # the tool description is the system turn
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}'
    assert f"<|im_start|>assistant\n{call}" in text
    assert '<|im_start|>user\n{"tool_response": {"name": "get_weather", "id": "call00001"' in text
    assert "<|im_start|>tool" not in text


@pytest.mark.parametrize(
    "text",
    [
        '{"response": "plain \\"quoted\\" caf\\u00e9 \\ud83d\\ude00\\nend"}',
        '{"response": "cut in an escape \\u00',
        '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "utc"}}]}',
        '{"tool_call": {"name": "get_time", "arguments": {"zone": "cet"}}}',
        '{"response": {"answer": "a \\"b\\"", "n": [1, 2]}}',
        '{"response": {"answer": "cut',
    ],
)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_the_stream_gives_what_the_whole_answer_gives(text: str, step: int) -> None:
    plan = plan_tools(ChatCompletionRequest(messages=[], tools=TOOLS), "", None)
    assert plan is not None
    content, calls = plan.extract(text)
    stream = ToolStream(plan)
    pieces, deltas = [], []
    for i in range(0, len(text), step):
        piece, d = stream.feed(text[i : i + step], i + step >= len(text))
        pieces.append(piece)
        deltas += d
    assert "".join(pieces) == (content or "")
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.name, c.arguments) for c in calls
    ]
    if text.startswith('{"response": "'):
        assert calls == [] and content and not content.startswith("{")
        assert sum(1 for p in pieces if p) > 1  # the answer streams as it is generated
    if text.startswith('{"response": {'):  # a JSON answer (response_format): the JSON itself
        assert calls == [] and content == text[len('{"response": ') :].removesuffix("}")
    if text.startswith('{"response": "plain'):
        assert content == json.loads(text)["response"]


def test_unparsable_text_is_the_content_and_a_cut_list_keeps_its_whole_calls() -> None:
    assert parse_generic("no json") == ("no json", [])
    plan = ToolPlan("generic", TOOLS)
    assert plan.extract('{"tool_calls": [{"name": "get_') == ('{"tool_calls": [{"name": "get_', [])
    one = '{"name": "get_time", "arguments": {"zone": "utc"}}'
    content, calls = plan.extract(f'{{"tool_calls": [{one}, {one}, {{"name": "get_wea')
    assert (
        content is None
        and [(c.name, json.loads(c.arguments)) for c in calls]
        == [("get_time", {"zone": "utc"})] * 2
    )
    content, [call] = plan.extract(f'{{"tool_call": {one}')
    assert content is None and call.name == "get_time"


# -- over HTTP, the tiny random model ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-generic-tools")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _answers(client: openai.OpenAI, stream: bool, n: int = 8, **kw: Any) -> list[dict[str, Any]]:
    """Each choice as {content, calls: [(name, arguments dict)], finish, content_deltas}."""
    args = dict(model=MODEL, n=n, temperature=1.0, seed=1, tools=TOOLS, **kw)
    args.setdefault("max_tokens", 48)
    args.setdefault("messages", [{"role": "user", "content": "Weather in Oslo for 2 days?"}])
    if not stream:
        resp = client.chat.completions.create(**args)
        return [
            {
                "content": c.message.content,
                "finish": c.finish_reason,
                "content_deltas": 1,
                "calls": [
                    (t.function.name, json.loads(t.function.arguments))
                    for t in c.message.tool_calls or []
                ],
            }
            for c in sorted(resp.choices, key=lambda c: c.index)
        ]
    out = [{"content": None, "finish": None, "content_deltas": 0, "calls": {}} for _ in range(n)]
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            o = out[c.index]
            # The first chunk carries content "" (as OpenAI's does): an empty answer is "".
            if c.delta.content is not None:
                o["content"] = (o["content"] or "") + c.delta.content
                o["content_deltas"] += bool(c.delta.content)
            for tc in c.delta.tool_calls or []:
                slot = o["calls"].setdefault(tc.index, [None, ""])
                slot[0] = slot[0] or (tc.function.name if tc.function else None)
                slot[1] += (tc.function.arguments or "") if tc.function else ""
            o["finish"] = c.finish_reason or o["finish"]
    for o in out:
        o["calls"] = [(n, json.loads(a)) for _, (n, a) in sorted(o["calls"].items())]
    return out


def _check_openai_shape(outs: list[dict[str, Any]]) -> None:
    for o in outs:
        if o["calls"]:
            assert o["finish"] == "tool_calls" and not o["content"], o
            for name, args in o["calls"]:
                jsonschema.validate(args, SCHEMAS[name])
        else:
            assert o["finish"] in ("stop", "length") and isinstance(o["content"], str), o
            # The plain answer's text, not the JSON object around it; only a call that
            # max_tokens cut before any call was whole is left as the text generated.
            if o["finish"] == "stop" or not o["content"].startswith('{"tool_call'):
                assert not o["content"].lstrip().startswith("{"), o


def test_tools_without_tool_choice_answer_in_openai_shape(client: openai.OpenAI) -> None:
    # One call per answer: a random model rarely closes an array of calls within max_tokens.
    whole = _answers(client, stream=False, n=16, parallel_tool_calls=False)
    streamed = _answers(client, stream=True, n=16, parallel_tool_calls=False)
    _check_openai_shape(whole)
    _check_openai_shape(streamed)
    # Both kinds of answer came out of the random weights, and the stream carries the same
    # answers as the whole responses (same seed, same samples).
    assert any(o["calls"] for o in whole) and any(not o["calls"] for o in whole)
    for w, st in zip(whole, streamed, strict=True):
        assert (w["content"] or None, w["calls"], w["finish"]) == (
            st["content"] or None,
            st["calls"],
            st["finish"],
        )
    assert any(o["content_deltas"] > 1 for o in streamed)  # plain answers stream in pieces


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_with_a_tool_result_is_answered(client: openai.OpenAI, stream: bool) -> None:
    outs = _answers(client, stream, messages=FOLLOW_UP)
    _check_openai_shape(outs)


@pytest.mark.parametrize("stream", [False, True])
def test_required_always_calls_with_valid_arguments(client: openai.OpenAI, stream: bool) -> None:
    outs = _answers(
        client, stream, tool_choice="required", parallel_tool_calls=False, max_tokens=100
    )
    for o in outs:
        assert o["finish"] == "tool_calls" and len(o["calls"]) == 1, o
        _check_openai_shape([o])


ANSWER = {
    "type": "object",
    "properties": {"mood": {"enum": ["good", "bad"]}},
    "required": ["mood"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_shapes_the_plain_answer(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": ANSWER}}
    outs = _answers(
        client, stream, n=16, parallel_tool_calls=False, response_format=fmt, max_tokens=100
    )
    answers = [o for o in outs if not o["calls"] and not o["content"].startswith('{"tool_call')]
    assert answers and any(o["calls"] for o in outs)
    _check_openai_shape([o for o in outs if o not in answers])
    for o in answers:
        assert o["finish"] == "stop", o
        jsonschema.validate(json.loads(o["content"]), ANSWER)


def test_tokenize_with_tools_shows_the_prompt(server: ServerProcess) -> None:
    msgs = [{"role": "user", "content": "Weather?"}]
    plain = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    with_tools = httpx.post(
        server.url + "/tokenize", json={"messages": msgs, "tools": TOOLS}
    ).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": with_tools["tokens"]}).json()
    assert with_tools["count"] > plain["count"] and "get_weather" in text["prompt"]


def test_an_unenforceable_schema_is_a_400_naming_the_tool_and_keyword(
    server: ServerProcess,
) -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "pick_number",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "multipleOf": 5}},
            },
        },
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER, bad],
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters", err
    assert "pick_number" in err["message"] and "multipleOf" in err["message"], err


def test_a_schema_the_grammar_cannot_compile_names_the_tool() -> None:
    from appliance.server.errors import APIError

    odd = {
        "type": "function",
        "function": {
            "name": "odd",
            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
        },
    }
    body = ChatCompletionRequest(messages=[], tools=[WEATHER, odd])
    with pytest.raises(APIError) as info:
        plan_tools(body, "", SMOLLM2_TEMPLATE)  # generic: the grammar constrains the calls
    assert info.value.status == 400 and info.value.param == "tools[1].function.parameters"
    assert "'odd'" in info.value.message and "nonsense" in info.value.message
    # A template's own format uses no grammar: the model's own call format is parsed.
    plan = plan_tools(body, "", (TEMPLATES / "qwen2.5_hermes.jinja").read_text())
    assert plan is not None and plan.mode == "auto"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (  # refused as the server reads it into the tools' grammar
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 3}},
                }
            },
            "response_format.json_schema.schema",
            "multipleOf",
        ),
        (
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        (  # refused by the engine's check of the combined grammar, named after its own field
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
            "nonsense",
        ),
    ],
)
def test_a_bad_answer_schema_beside_tools_is_a_400_naming_its_field(
    server: ServerProcess, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ": "), err
    assert words in err["message"], err

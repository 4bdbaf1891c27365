"""Tool-call parsers round-trip the chat templates of Qwen2.5 (hermes), Llama 3.1 (JSON) and
Mistral v0.3 (tests/templates, written out as text): what the template renders for an
assistant turn with tool_calls parses back to the same calls, whole and streamed in pieces;
and over HTTP, `auto` renders the tools through the model's template and accepts a
conversation with assistant tool_calls and tool results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, write_template
from transformers import AutoTokenizer

from appliance.server.schemas import ChatCompletionRequest
from appliance.server.tool_calls import ToolPlan, ToolStream, template_tool_calls
from appliance.server.tool_parsers import PARSERS

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
CALLS = [("get_weather", {"city": 'Paris, "FR"', "days": 3}), ("get_time", {"zone": "CET"})]
# (template, parser, end of the assistant turn, calls per turn)
FAMILIES = [
    ("qwen2.5_hermes.jinja", "hermes", "<|im_end|>\n", 2),
    ("llama3.1_json.jinja", "llama3_json", "<|eot_id|>", 1),
    ("mistral_v0.3.jinja", "mistral", "</s>", 2),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.eos_token = "</s>"
    return tok


def _openai_calls(n: int) -> list[dict[str, Any]]:
    # As clients send them: arguments as JSON text; 9-character ids (Mistral insists).
    return [
        {
            "id": f"call{i:05d}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(CALLS[:n])
    ]


def _render(tok: Any, template: str, messages: list[dict[str, Any]], gen: bool) -> str:
    return tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=template, add_generation_prompt=gen, tokenize=False
    )


@pytest.mark.parametrize(("name", "parser", "eot", "n"), FAMILIES)
def test_parser_round_trips_the_template(
    tokenizer: Any, name: str, parser: str, eot: str, n: int
) -> None:
    template = (TEMPLATES / name).read_text()
    convo = [{"role": "user", "content": "Weather in Paris and the time?"}]
    prefix = _render(tokenizer, template, convo, True)
    assert "get_weather" in prefix and "get_time" in prefix  # the tools were offered
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": template_tool_calls(_openai_calls(n), 1),
    }
    full = _render(tokenizer, template, [*convo, assistant], False)
    assert full.startswith(prefix)
    text = full[len(prefix) :].removesuffix(eot)
    content, calls = PARSERS[parser](text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:n]
    # Streamed in small pieces, the deltas assemble to the same calls.
    stream = ToolStream(ToolPlan("auto", TOOLS, parser=parser))
    got_content, deltas = "", []
    for i in range(0, len(text), 3):
        piece, d = stream.feed(text[i : i + 3], i + 3 >= len(text))
        got_content += piece
        deltas += d
    assert got_content == "" and stream.made_calls
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == CALLS[:n]
    # The conversation goes on with the tool's answers, and the template takes it.
    answers = [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"ok": true}'}
        for c in _openai_calls(n)
    ]
    rendered = _render(tokenizer, template, [*convo, assistant, *answers], True)
    assert rendered.count("ok") >= n


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_plain_text_is_content_not_a_call(parser: str) -> None:
    text = "The weather is fine, no tool needed."
    assert PARSERS[parser](text) == (text, [])
    stream = ToolStream(ToolPlan("auto", TOOLS, parser=parser))
    out = "".join(
        stream.feed(text[i : i + 4], i + 4 >= len(text))[0] for i in range(0, len(text), 4)
    )
    assert out == text and not stream.made_calls


def test_hermes_keeps_the_text_before_a_call() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, [call] = PARSERS["hermes"](text)
    assert content == "Let me check." and call.name == "get_time"


# -- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-tools")
    model = d / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (TEMPLATES / "qwen2.5_hermes.jinja").read_text()
    cfg_path.write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.jinja"):
        extra.unlink()
    t = write_template(d / "t.toml", model)
    t.write_text(
        t.read_text()
        .replace('name = "tiny"\n', 'name = "tiny"\ntool_call_parser = "hermes"\n')
        .replace("max_model_len = 512", "max_model_len = 1024")
    )
    srv = ServerProcess(t, d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(srv: ServerProcess, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def test_auto_renders_the_tools_and_takes_tool_turns(qwen_server: ServerProcess) -> None:
    convo = [{"role": "user", "content": "Weather in Paris?"}]
    plain = _post(qwen_server, messages=convo).json()
    auto = _post(qwen_server, messages=convo, tools=TOOLS, tool_choice="auto").json()
    none = _post(qwen_server, messages=convo, tools=TOOLS, tool_choice="none").json()
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert auto["choices"][0]["finish_reason"] in ("stop", "length")
    turns = [
        *convo,
        {"role": "assistant", "content": None, "tool_calls": _openai_calls(1)},
        {"role": "tool", "tool_call_id": "call00000", "content": "sunny, 21 C"},
    ]
    r = _post(qwen_server, messages=turns, tools=TOOLS)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > auto["usage"]["prompt_tokens"]


def test_a_parser_without_a_template_for_tools_is_a_400(tiny_model_dir: Path) -> None:
    from appliance.server.errors import APIError
    from appliance.server.tool_calls import plan_tools

    body = ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice="auto")
    with pytest.raises(APIError) as info:
        plan_tools(body, "hermes", "{{ messages }}")
    assert info.value.status == 400 and info.value.param == "tools"

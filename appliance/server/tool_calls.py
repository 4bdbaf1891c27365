"""Function calling in chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

- `none`: the tools are not offered; plain text comes back.
- a named function: the output is constrained to that function's parameter schema; the text
  *is* the call's arguments (valid by construction).
- `required`: the output is constrained to a JSON array of {name, parameters} objects over
  the tools (one item unless parallel_tool_calls), so some call is always made, validly.
- `auto`: the tools are rendered by the model's chat template (transformers'
  `apply_chat_template(tools=...)`) and the model's own call format is parsed back out by the
  configured parser (model.tool_call_parser, server/tool_parsers.py).

Checked before anything is queued: each tool's shape and parameter schema, a named function
that is not in `tools`, `auto` on a model with no parser or a template that cannot render tools.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.engine.guided_check import StructuredError, check_schema
from appliance.sampling_params import StructuredOutputs
from appliance.server import schemas as s
from appliance.server.errors import bad_request
from appliance.server.limits import check_tool_choice
from appliance.server.tool_parsers import MARKERS, PARSERS, ParsedCall

Mode = Literal["named", "required", "auto"]


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolPlan:
    mode: Mode
    # The tools as the chat template takes them ({"type": "function", "function": {...}}).
    tools: list[dict[str, Any]]
    # A named choice's function; the parser's name for auto.
    name: str = ""
    parser: str = ""
    parallel: bool = True
    structured: StructuredOutputs | None = None

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The message content and the calls a finished output holds."""
        if self.mode == "named":
            return None, [ParsedCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut by max_tokens: no valid call to report
            return None, [
                ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
            ]
        return PARSERS[self.parser](text)


def _function(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{param}: only tools of type function are supported", param=param)
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{param}.function.name: required (a string)", param=f"{param}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    try:
        text = check_schema(params)
    except StructuredError as exc:
        p = f"{param}.function.parameters"
        raise bad_request(f"{p}: {exc}", param=p) from None
    return {**fn, "parameters": json.loads(text)}


def _required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"enum": [f["name"]]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
            }
            for f in functions
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(
    body: s.ChatCompletionRequest, parser: str, chat_template: str | None
) -> ToolPlan | None:
    """The request's tool plan (None: no tools offered); 400 naming the field when bad."""
    # The shape of tool_choice and its consistency with tools: one rule (server/limits.py).
    check_tool_choice(body.tools, body.tool_choice)
    choice = body.tool_choice
    if not body.tools:
        return None
    functions = [_function(i, t) for i, t in enumerate(body.tools)]
    tools = [{"type": "function", "function": f} for f in functions]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    by_name = {f["name"]: f for f in functions}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(
                'tool_choice: expected {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in by_name:
            raise bad_request(
                f"tool_choice: function {name!r} is not among the tools ({', '.join(by_name)})",
                param="tool_choice",
            )
        schema = json.dumps(by_name[name]["parameters"])
        return ToolPlan("named", tools, name=name, structured=StructuredOutputs(kind="json", spec=schema))
    if choice == "required":
        schema = json.dumps(_required_schema(functions, body.parallel_tool_calls))
        return ToolPlan(
            "required", tools, parallel=body.parallel_tool_calls,
            structured=StructuredOutputs(kind="json", spec=schema),
        )  # fmt: skip
    if choice != "auto":
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            param="tool_choice",
        )
    if not parser:
        raise bad_request(
            "tool_choice: auto needs this model's tool-call parser; the server has none "
            "(model.tool_call_parser: hermes, llama3_json or mistral)",
            param="tool_choice",
        )
    if not chat_template or "tools" not in chat_template:
        raise bad_request(
            f"tools: this model's chat template does not render tools (parser {parser!r})",
            param="tools",
        )
    return ToolPlan("auto", tools, parser=parser, parallel=body.parallel_tool_calls)


def template_tool_calls(calls: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object
    (templates write `arguments | tojson`), as vLLM passes them."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        param = f"messages[{i}].tool_calls[{j}].function"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{param}: a name is required", param=param)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                raise bad_request(f"{param}.arguments: not valid JSON", param=f"{param}.arguments") from None
        out.append({**call, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def tool_calls(calls: list[ParsedCall]) -> list[s.ToolCall]:
    return [s.ToolCall(call_id(), s.FunctionCall(c.name, c.arguments)) for c in calls]


@dataclass
class ToolStream:
    """One streamed choice's tool-call deltas: a named call streams its arguments as they
    come; `required` and `auto` calls are parsed whole at the finish (plain `auto` text that
    cannot start a call streams as content at once)."""

    plan: ToolPlan
    held: str = ""
    # auto: the text so far is content (streamed); a marker later switches back to holding.
    content_mode: bool = False
    started: bool = False
    made_calls: bool = False
    ids: list[str] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> tuple[str, list[s.DeltaToolCall]]:
        plan = self.plan
        if plan.mode == "named":
            deltas = []
            if not self.started:
                self.started = self.made_calls = True
                fn = s.DeltaFunction(name=plan.name, arguments=text)
                deltas.append(s.DeltaToolCall(0, call_id(), "function", fn))
            elif text:
                deltas.append(s.DeltaToolCall(0, function=s.DeltaFunction(arguments=text)))
            return "", deltas
        self.held += text
        if plan.mode == "auto" and not finished:
            return self._auto_content(), []
        if not finished:
            return "", []
        content, calls = plan.extract(self.held)
        self.held = ""
        self.made_calls = bool(calls)
        deltas = [
            s.DeltaToolCall(j, call_id(), "function", s.DeltaFunction(c.name, c.arguments))
            for j, c in enumerate(calls)
        ]
        return content or "", deltas

    def _auto_content(self) -> str:
        """Release what cannot be (the start of) a call; hold the rest."""
        markers = MARKERS[self.plan.parser]
        text = self.held
        stripped = text.lstrip()
        if not self.content_mode:
            if not stripped or any(m.startswith(stripped[: len(m)]) for m in markers):
                return ""  # empty so far, or may still be a call
            self.content_mode = True
        # Content: pass it on, but keep back a tail that could begin a marker.
        for m in markers:
            if len(m) > 1 and m in text:
                cut = text.index(m)
                self.content_mode = False
                self.held = text[cut:]
                return text[:cut]
        keep = 0
        for m in markers:
            for n in range(min(len(m) - 1, len(text)), 0, -1):
                if m.startswith(text[-n:]) and len(m) > 1:
                    keep = max(keep, n)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

"""Function calling in chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

- `none`: the tools are not offered; plain text comes back.
- a named function: the output is constrained to that function's parameter schema; the text
  *is* the call's arguments (valid by construction).
- `required`: on a template with its own tool format, the output is constrained to a JSON
  array of {name, parameters} objects over the tools (one item unless parallel_tool_calls);
  on any other template, to the generic format's calls (below). Some call is always made,
  validly.
- `auto` (also what `tools` without `tool_choice` means): when the chat template has a tool
  format of its own (model.tool_call_parser, or detected from the template:
  server/chat_caps.py), the template renders the tools and that format is parsed back out
  (server/tool_parsers.py). Otherwise the generic format (server/tool_generic.py): the tools
  described in a system message, the answer constrained to a call of a tool or a plain
  answer, which comes back as the content.

Checked before anything is queued: each tool's shape and parameter schema (a 400 naming the
tool and the keyword the grammar cannot enforce), a named function that is not in `tools`, a
configured parser whose template cannot render tools.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.engine.guided_check import StructuredError, check, check_schema
from appliance.sampling_params import StructuredOutputs
from appliance.server import schemas as s
from appliance.server.chat_caps import detect_parser
from appliance.server.errors import bad_request
from appliance.server.limits import check_tool_choice
from appliance.server.tool_generic import (
    ResponseStream,
    generic_schema,
    instructions,
    named_instructions,
    parse_generic,
)
from appliance.server.tool_parsers import MARKERS, PARSERS, ParsedCall

# generic: the generic JSON format (tool_generic.py), for auto and required alike.
Mode = Literal["named", "required", "auto", "generic"]


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
    # The tools' description for the system message where the template has no tool format
    # (generic, and named on such a template); generic: whether a call is required.
    preamble: str = ""
    required: bool = False

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template: none where they are described in the preamble
        (a template without a tool format would drop or garble them)."""
        return None if self.preamble else self.tools

    @property
    def choice(self) -> str:
        """The tool_choice this plan answers, for messages."""
        if self.mode == "generic":
            return "required" if self.required else "auto"
        return self.mode

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
                ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                for i in items
            ]
        if self.mode == "generic":
            return parse_generic(text)
        return PARSERS[self.parser](text)


def _function(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{param}: only tools of type function are supported", param=param)
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(
            f"{param}.function.name: required (a string)", param=f"{param}.function.name"
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    try:
        text = check_schema(params)
    except StructuredError as exc:
        raise _schema_error(i, fn["name"], exc) from None
    return {**fn, "parameters": json.loads(text)}


def _schema_error(i: int, name: str, exc: StructuredError) -> Exception:
    p = f"tools[{i}].function.parameters"
    return bad_request(f"{p} (function {name!r}): {exc}", param=p)


def _compiles(functions: list[dict[str, Any]], only: str | None = None) -> None:
    """The grammar's own check of each tool whose schema will constrain the output (`only`:
    that one), so that a schema it cannot compile is refused naming the tool rather than as
    the request's combined schema. Not for a template's own format: no grammar there."""
    for i, fn in enumerate(functions):
        if only is None or fn["name"] == only:
            try:
                check(StructuredOutputs(kind="json", spec=json.dumps(fn["parameters"])))
            except StructuredError as exc:
                raise _schema_error(i, fn["name"], exc) from None


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


def _generic(
    functions: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    parallel: bool,
    required: bool,
    answer: dict[str, Any] | None = None,
) -> ToolPlan:
    schema = json.dumps(generic_schema(functions, parallel, required, answer))
    return ToolPlan(
        "generic",
        tools,
        parallel=parallel,
        required=required,
        structured=StructuredOutputs(kind="json", spec=schema),
        preamble=instructions(functions, parallel, required, answer),
    )


def with_output_constraint(plan: ToolPlan, so: StructuredOutputs, param: str) -> ToolPlan:
    """`plan` under the request's own output constraint too (given by the field `param`): the
    generic format's plain answer follows a JSON schema or object (response_format, as
    llama.cpp does); anything else cannot be combined with a constrained tool choice (400)."""
    if plan.mode != "generic" or plan.required or so.kind not in ("json", "json_object"):
        where = " on a template without a tool format" if plan.mode == "generic" else ""
        raise bad_request(
            f"response_format: cannot be combined with tool_choice {plan.choice}{where}"
            + (" (only a JSON schema or object can)" if plan.choice == "auto" else ""),
            param="response_format",
        )
    answer: dict[str, Any] = {"type": "object", "additionalProperties": True}
    if so.kind == "json":
        try:  # the schema is read to be embedded; the combined grammar is the engine's check
            answer = json.loads(check_schema(so.spec))
        except StructuredError as exc:
            raise bad_request(f"{param}: {exc}", param=param) from None
    return _generic([t["function"] for t in plan.tools], plan.tools, plan.parallel, False, answer)


def plan_tools(
    body: s.ChatCompletionRequest, parser: str, chat_template: str | None
) -> ToolPlan | None:
    """The request's tool plan (None: no tools offered); 400 naming the field when bad.
    `parser` is the configured one ("" : none); else the template's own format is used when
    it has one, the generic format when not."""
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
        _compiles(functions, only=name)
        schema = json.dumps(by_name[name]["parameters"])
        # A template without a tool format is told which tool it calls and its schema (the
        # grammar alone would make valid arguments, but blind ones).
        has_format = bool(parser or detect_parser(chat_template))
        return ToolPlan(
            "named",
            tools,
            name=name,
            structured=StructuredOutputs(kind="json", spec=schema),
            preamble="" if has_format else named_instructions(by_name[name]),
        )
    configured = bool(parser)
    parser = parser or detect_parser(chat_template)
    if choice == "required" or not parser:
        _compiles(functions)
    if choice == "required":
        if not parser:
            return _generic(functions, tools, body.parallel_tool_calls, required=True)
        schema = json.dumps(_required_schema(functions, body.parallel_tool_calls))
        return ToolPlan(
            "required",
            tools,
            parallel=body.parallel_tool_calls,
            structured=StructuredOutputs(kind="json", spec=schema),
        )
    if choice != "auto":
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            param="tool_choice",
        )
    if not parser:
        return _generic(functions, tools, body.parallel_tool_calls, required=False)
    if configured and (not chat_template or "tools" not in chat_template):
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
                raise bad_request(
                    f"{param}.arguments: not valid JSON", param=f"{param}.arguments"
                ) from None
        out.append(
            {**call, "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def tool_calls(calls: list[ParsedCall]) -> list[s.ToolCall]:
    return [s.ToolCall(call_id(), s.FunctionCall(c.name, c.arguments)) for c in calls]


@dataclass
class ToolStream:
    """One streamed choice's tool-call deltas: a named call streams its arguments as they
    come; `required`, `auto` and generic calls are parsed whole at the finish (plain `auto`
    text that cannot start a call streams as content at once, and so does a generic plain
    answer's text, JSON escapes decoded, as its string is generated)."""

    plan: ToolPlan
    held: str = ""
    # auto: the text so far is content (streamed); a marker later switches back to holding.
    content_mode: bool = False
    started: bool = False
    made_calls: bool = False
    ids: list[str] = field(default_factory=list)
    answer: ResponseStream = field(default_factory=ResponseStream)

    def feed(self, text: str, finished: bool) -> tuple[str, list[s.DeltaToolCall]]:
        plan = self.plan
        if plan.mode == "generic":
            content = self.answer.feed(text)
            if self.answer.mode == "response" or not finished:
                return content, []  # a plain answer: all of it is out once generated
            text, self.held = self.answer.text, ""
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
        body, calls = plan.extract(self.held)
        self.held = ""
        self.made_calls = bool(calls)
        deltas = [
            s.DeltaToolCall(j, call_id(), "function", s.DeltaFunction(c.name, c.arguments))
            for j, c in enumerate(calls)
        ]
        return body or "", deltas

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

"""The generic tool-call format, for chat templates that have none of their own (ChatML such
as SmolLM2's, the demo models' templates), after llama.cpp's generic format:

- the tools are described to the model in a system message (names, descriptions, argument
  schemas and the answer format), or in the first user turn when the template has no system
  role (server/chat_caps.py);
- the answer is constrained by a JSON schema (the structured-output grammar) to exactly one
  object: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (`{"tool_call": {...}}`
  without parallel calls), arguments valid against that tool's schema, or, unless a call is
  required, `{"response": "plain answer"}`;
- the object is read back into OpenAI's shape: calls, or the answer's text as the content (never
  the wrapper), streamed as it is generated (ResponseStream). With a JSON response_format the
  plain answer is a JSON value of that schema instead of a string, and the content is it.

A conversation's earlier assistant calls and tool results are written in the same format for
templates that cannot render them (`calls_text`, `tool_result_text`, used by
`chat_caps.adapt_conversation`), so the model sees its own format.
"""

from __future__ import annotations

import json
import re
from typing import Any

from appliance.server.tool_parsers import ParsedCall

RESPONSE_KEY = "response"


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"enum": [fn["name"]]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
    }


def generic_schema(
    functions: list[dict[str, Any]],
    parallel: bool,
    required: bool,
    answer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One JSON object: a call (or several) of the tools, or a plain answer unless required
    (a string; or a JSON value of the `answer` schema when response_format asks for one)."""
    calls = [_call_schema(f) for f in functions]
    item: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        call: dict[str, Any] = {
            "type": "object",
            "properties": {"tool_calls": {"type": "array", "items": item, "minItems": 1}},
            "required": ["tool_calls"],
        }
    else:
        call = {"type": "object", "properties": {"tool_call": item}, "required": ["tool_call"]}
    if required:
        return call
    plain = {
        "type": "object",
        "properties": {RESPONSE_KEY: answer or {"type": "string"}},
        "required": [RESPONSE_KEY],
    }
    return {"anyOf": [call, plain]}


def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def _describe(f: dict[str, Any]) -> str:
    desc = f.get("description") or ""
    return f"- {f['name']}: {desc}{'; ' if desc else ''}{_compact(f['parameters'])}"


def instructions(
    functions: list[dict[str, Any]],
    parallel: bool,
    required: bool,
    answer: dict[str, Any] | None = None,
) -> str:
    """The tool description the model reads. Kept short: small models have small contexts."""
    lines = ["You can use these tools (name: description; JSON schema of the arguments):"]
    lines += [_describe(f) for f in functions]
    one = '{"name": "<tool name>", "arguments": {<arguments>}}'
    call = f'{{"tool_calls": [{one}]}}' if parallel else f'{{"tool_call": {one}}}'
    what = "to call one or more tools" if parallel else "to call a tool"
    if required:
        lines.append(f"Answer with one JSON object {what}: {call}")
    else:
        reply = "<your answer as JSON>" if answer else '"<your answer>"'
        lines.append(
            f"Answer with one JSON object, either {call} {what}, "
            f'or {{"{RESPONSE_KEY}": {reply}}} to answer directly.'
        )
        if answer:
            lines.append(f"JSON schema of your answer: {_compact(answer)}")
    return "\n".join(lines)


def named_instructions(f: dict[str, Any]) -> str:
    """For a named tool_choice: the one tool, whose arguments are the whole answer."""
    return "\n".join(
        [
            "Call this tool (name: description; JSON schema of the arguments):",
            _describe(f),
            "Answer with the arguments of the call, as one JSON object.",
        ]
    )


# -- reading the answer back ---------------------------------------------------------------------
def _calls(obj: dict[str, Any]) -> list[ParsedCall] | None:
    items = obj["tool_calls"] if "tool_calls" in obj else [obj.get("tool_call")]
    if not isinstance(items, list) or not items:
        return None
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args = it.get("arguments", {})
        out.append(ParsedCall(it["name"], json.dumps(args, ensure_ascii=False)))
    return out


_CALLS_HEAD = re.compile(r'\s*\{\s*"tool_call(s?)"\s*:\s*(\[?)')


def _completed_calls(text: str) -> list[ParsedCall]:
    """The whole calls at the start of a `tool_calls` array that max_tokens cut (or a whole
    `tool_call` whose closing brace it cut): small models at temperature 0 tend to repeat
    calls until the limit, and the ones they finished are valid (the grammar made them)."""
    m = _CALLS_HEAD.match(text)
    if m is None or bool(m.group(1)) != bool(m.group(2)):
        return []
    dec, pos = json.JSONDecoder(), m.end()
    items: list[Any] = []
    while not items or m.group(1):  # one item for "tool_call", as many as whole for a list
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        try:
            item, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
    return _calls({"tool_calls": items}) or []


def parse_generic(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a generic answer. Cut by max_tokens, a plain answer gives its text
    generated so far (as streamed), a list of calls the calls it completed; anything else
    that does not parse is the content as is."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        stream = ResponseStream()
        answer = stream.feed(text)
        if stream.mode == "response":
            return answer, []
        if stream.mode == "value":  # a JSON answer cut short: what there is of it
            return text[stream.pos :], []
        calls = _completed_calls(text)
        return (None, calls) if calls else (text, [])
    if isinstance(obj, dict) and RESPONSE_KEY in obj:
        answer = obj[RESPONSE_KEY]
        return (
            _clean(answer) if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
        ), []
    if isinstance(obj, dict) and ("tool_calls" in obj or "tool_call" in obj):
        found = _calls(obj)
        if found:
            return None, found
    return text, []


_HEAD = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"\s*(?::\s*("?))?')


def _string_prefix(text: str, start: int) -> tuple[str, int, bool]:
    """Decode the JSON string body at text[start:] as far as it is complete: (text, end of
    what was decoded, whether the closing quote was reached). An escape split across tokens
    (`\\`, `\\u00`, half a surrogate pair) waits for its end."""
    i, n, safe = start, len(text), start
    closed = False
    while i < n:
        c = text[i]
        if c == '"':
            closed = True
            break
        if c == "\\":
            if i + 1 >= n:
                break
            if text[i + 1] == "u":
                if i + 6 > n:
                    break
                try:
                    code = int(text[i + 2 : i + 6], 16)
                except ValueError:
                    code = 0
                width = 6
                if 0xD800 <= code < 0xDC00:  # a high surrogate: its pair may follow
                    after = text[i + 6 : i + 8]
                    if len(after) < 2 and "\\u".startswith(after):
                        break
                    width = 12 if after == "\\u" else 6
                if i + width > n:
                    break
                i += width
            else:
                i += 2
        else:
            i += 1
        safe = i
    body = text[start:safe]
    try:
        decoded = json.loads('"' + body + '"', strict=False)
    except json.JSONDecodeError:
        decoded = body
    return _clean(decoded), (safe + 1 if closed else safe), closed


def _clean(s: str) -> str:
    """A lone surrogate (a `\\ud83d` escape without its pair) cannot be sent as UTF-8: it is
    dropped rather than fail the response."""
    if any("\ud800" <= ch <= "\udfff" for ch in s):
        return s.encode("utf-8", "ignore").decode("utf-8")
    return s


class ResponseStream:
    """Incremental reader of one generic answer: once the first key is known to be
    `response` with a string, the answer's text comes out as it is generated, JSON escapes
    decoded; a call (mode "call") or a JSON answer (mode "value", response_format) is held
    and read whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = ""  # "" undecided, "response", "value", "call"
        self.pos = 0  # where the undecoded rest of the answer string starts
        self.closed = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if not self.mode:
            m = _HEAD.match(self.text)
            if m is None:
                # Not even a key yet; anything but the start of an object is no answer.
                stripped = self.text.lstrip()
                if stripped and not stripped.startswith("{"):
                    self.mode = "call"
                return ""
            if m.group(1) != RESPONSE_KEY:
                self.mode = "call"
                return ""
            if m.group(2) is None or m.end() == len(self.text) and m.group(2) == "":
                return ""  # the key, not yet its value
            if m.group(2) != '"':
                self.mode, self.pos = "value", m.end()
                return ""
            self.mode, self.pos = "response", m.end()
        if self.mode != "response" or self.closed:
            return ""
        out, self.pos, self.closed = _string_prefix(self.text, self.pos)
        return out


def calls_text(calls: list[dict[str, Any]], parallel: bool = True) -> str:
    """An earlier assistant turn's calls (OpenAI's tool_calls, arguments as objects) written
    as the generic answer, for templates that cannot render tool_calls; the ids stay, so
    that the tool results (tool_result_text) can say which call they answer."""
    items = []
    for c in calls:
        fn = c.get("function") or {}
        item = {"name": fn.get("name"), "arguments": fn.get("arguments", {})}
        if c.get("id"):
            item["id"] = c["id"]
        items.append(item)
    if not parallel and len(items) == 1:
        return _compact({"tool_call": items[0]})
    return _compact({"tool_calls": items})


def tool_result_text(content: str, name: str | None, call_id: str | None) -> str:
    """A tool's answer as a user turn's text, naming the call it answers."""
    result: dict[str, Any] = {}
    if name:
        result["name"] = name
    if call_id:
        result["id"] = call_id
    result["content"] = content
    return _compact({"tool_response": result})

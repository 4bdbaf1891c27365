"""Tool-call parsers: a model's text back into (content, calls), one per model family, as
vLLM's `--tool-call-parser` chooses them. Each reads what that family's chat template writes
for an assistant turn with `tool_calls` (tests/templates hold the templates), with or without
the marker: a marker that is a special token ([TOOL_CALLS], <|python_tag|>) is dropped when
the output is decoded with skip_special_tokens, as this server decodes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    # JSON text of the arguments object.
    arguments: str


def _call(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values in `text`, separated by whitespace or `separators`."""
    dec = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Hermes / Qwen2: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` each."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        values = _json_values(body, "")
        call = _call(values[0]) if values and len(values) == 1 else None
        if call is None:
            return text, []  # not well-formed: the text is the answer
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Llama 3.1+ JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;`,
    optionally after <|python_tag|>."""
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    values = _json_values(body, ";")
    calls = [_call(v, "parameters") for v in values or []]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def parse_mistral(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""
    start = text.find("[TOOL_CALLS]")
    content = text[:start].strip() if start >= 0 else ""
    body = (text[start + len("[TOOL_CALLS]") :] if start >= 0 else text).strip()
    if not body.startswith("["):
        return text, []
    values = _json_values(body, "")
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return text, []
    calls = [_call(v) for v in values[0]]
    if not calls or any(c is None for c in calls):
        return text, []
    return content or None, [c for c in calls if c is not None]


Parser = Callable[[str], tuple[str | None, list[ParsedCall]]]
PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
# What a call's text starts with, per parser, for streaming: text that might still become
# a call is held back until it is known ("" : the text itself starts with JSON).
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>", "{"),
    "mistral": ("[TOOL_CALLS]", "["),
}

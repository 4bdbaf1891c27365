"""Input limits that the schema alone cannot state, checked before anything expensive.

- JSON nesting depth, on the raw bytes before decoding: msgspec recurses once per level, and a
  body nested 100,000 deep ends in a RecursionError (it was a 500). The check costs two
  `bytes.count` calls for an ordinary body.
- Token ids within the vocabulary: stop_token_ids (the engine checks only the prompt's), and
  a prompt's ids beyond 64 bits, which cannot even be encoded for the engine core (msgpack);
  in the engine's words (engine/request_checks.py).
- Chat roles from OpenAI's set, and `tool_choice` consistent with `tools`.

Every refusal is a 400 naming the field and the limit. Integer ranges that are pure schema
(seed, n, max_tokens, logprobs, ...) are msgspec constraints in schemas.py.
"""

from __future__ import annotations

import re
from typing import Any

from appliance.engine import request_checks
from appliance.server.errors import bad_request

# Deepest JSON nesting accepted (objects and arrays). A chat request needs about 4 levels, a
# tool's JSON-schema parameters a dozen or so; 64 leaves room and stops the recursion long
# before the interpreter's limit (1000).
MAX_JSON_DEPTH = 64
# OpenAI's chat roles ("function" is the deprecated predecessor of "tool").
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})

# A JSON string literal, escapes included: brackets inside strings do not nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS_ONLY = bytes(range(256)).translate(None, b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when `raw` nests objects/arrays deeper than `limit`. Malformed JSON is left to the
    decoder (it reports where); only well-nested excess depth is flagged here."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # cannot be deeper than the number of openers
    brackets = _STRING.sub(b"", raw).translate(_SQUARE, _BRACKETS_ONLY)
    # Each pass removes the innermost level of every nest ("[]" pairs); whatever still holds a
    # pair after `limit` passes was nested deeper. C-speed passes, at most `limit` of them; a
    # run of more opening brackets than the levels left ends it at once (a plain deep nest).
    for done in range(limit):
        if b"[" * (limit - done + 1) in brackets:
            return True
        shorter = brackets.replace(b"[]", b"")
        if shorter == brackets:
            return False
        brackets = shorter
    return b"[]" in brackets


def check_json_depth(raw: bytes) -> None:
    if json_depth_exceeds(raw):
        raise bad_request(
            f"invalid request body: JSON nested deeper than {MAX_JSON_DEPTH} levels",
            code="json_too_deep",
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Every id in [0, vocab_size); `param` names the field in the error."""
    try:
        request_checks.check_token_ids(ids, vocab_size, param)
    except request_checks.InvalidRequest as exc:
        raise bad_request(str(exc), param=param) from None


def check_top_k(top_k: int | None, vocab_size: int) -> None:
    if top_k is not None and top_k > vocab_size:
        raise bad_request(
            f"top_k must be -1, 0 (disabled) or at most the vocabulary size {vocab_size}, "
            f"got {top_k}",
            param="top_k",
        )


def check_roles(roles: list[str]) -> None:
    for i, role in enumerate(roles):
        if role not in CHAT_ROLES:
            allowed = ", ".join(sorted(CHAT_ROLES))
            raise bad_request(
                f"messages[{i}].role: {role!r} is not a chat role; expected one of {allowed}",
                param=f"messages[{i}].role",
            )


def _tool_names(tools: list[Any]) -> set[str]:
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else getattr(tool, "function", None)
        name = fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", None)
        if isinstance(name, str):
            names.add(name)
    return names


def check_tool_choice(tools: list[Any] | None, tool_choice: Any) -> None:
    """OpenAI's rules: "none" and "auto" always; "required" or a named function only with
    `tools`, and the named function must be one of them."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            raise bad_request(
                f"tool_choice: {tool_choice!r} is not one of 'none', 'auto', 'required' or a "
                "named function",
                param="tool_choice",
            )
        named = None
    else:
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if (
            not isinstance(tool_choice, dict)
            or tool_choice.get("type") != "function"
            or (not isinstance(named, str))
        ):
            raise bad_request(
                'tool_choice: a named tool choice is {"type": "function", "function": '
                '{"name": ...}}',
                param="tool_choice",
            )
    if not tools:
        what = "'required'" if named is None else f"function {named!r}"
        raise bad_request(
            f"tool_choice: {what} needs `tools`, and the request has none", param="tool_choice"
        )
    if named is not None and named not in _tool_names(tools):
        raise bad_request(
            f"tool_choice: function {named!r} is not among the request's tools",
            param="tool_choice",
        )

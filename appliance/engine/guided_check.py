"""Validation of a structured-output constraint before it costs anything: the text must parse,
and a JSON schema must use only what the grammar compiler enforces.

xgrammar turns a schema into a grammar and raises on what it cannot read (bad JSON, an unknown
type, a malformed regex), but it silently ignores some keywords (multipleOf, uniqueItems,
patternProperties, unknown formats...). Output "valid against its schema" would then be a lie,
so those are refused here with a message naming the keyword and where it is, as vLLM does
(`has_xgrammar_unsupported_json_features`). No tokenizer is needed: Engine.add_request runs
this (engine/request_checks.py), the API process only on the tools' schemas (to name the tool).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from appliance.sampling_params import StructuredOutputs

# Keywords xgrammar parses but does not enforce.
_UNSUPPORTED = {
    "multipleOf": "multipleOf",
    "uniqueItems": "uniqueItems",
    "contains": "contains",
    "minContains": "minContains",
    "maxContains": "maxContains",
    "patternProperties": "patternProperties",
    "propertyNames": "propertyNames",
    "dependentSchemas": "dependentSchemas",
    "dependentRequired": "dependentRequired",
    "if": "if/then/else",
    "not": "not",
}
# String formats xgrammar turns into a grammar (others would be accepted and ignored).
_FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "uuid",
    "ipv4",
    "ipv6",
    "hostname",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
}


class StructuredError(ValueError):
    """A constraint that cannot be enforced; `detail` says why (the caller adds the field)."""


def _walk(node: Any, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key, label in _UNSUPPORTED.items():
        if key in node:
            raise StructuredError(f"unsupported JSON schema feature {label!r} at {path or '/'}")
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in _FORMATS:
        raise StructuredError(f"unsupported string format {fmt!r} at {path or '/'}")
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not subschemas
        if key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/properties/{name}")
        elif isinstance(value, (dict, list)):
            _walk(value, f"{path}/{key}")


def check_schema(schema: Any) -> str:
    """The schema as compact JSON text, after refusing what cannot be enforced."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise StructuredError(f"the schema is not valid JSON: {exc}") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuredError(f"a JSON schema must be an object, got {type(schema).__name__}")
    _walk(schema, "")
    return json.dumps(schema, separators=(",", ":"))


def _xgr_message(exc: Exception) -> str:
    # xgrammar's messages start with "[time] /project/cpp/file.cc:line: "; keep the reason.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, tail = text.rpartition(".cc:")
    if sep:
        text = tail.split(": ", 1)[-1]
    return text


def check(so: StructuredOutputs) -> StructuredOutputs:
    """Raise StructuredError unless `so` compiles into an enforceable grammar; returns it
    with a JSON schema normalised (compact text: one cache entry per schema)."""
    try:
        if so.kind == "json":
            text = check_schema(so.spec)
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
            return StructuredOutputs(kind="json", spec=text)
        if so.kind == "regex":
            xgr.Grammar.from_regex(so.spec)
        elif so.kind == "grammar":
            xgr.Grammar.from_ebnf(so.spec)
        elif so.kind == "choice":
            choices = json.loads(so.spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise StructuredError("choice must be a non-empty list of strings")
    except StructuredError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with its parser's reason
        raise StructuredError(_xgr_message(exc)) from None
    return so


def choice_ebnf(spec: str) -> str:
    """A grammar that matches exactly one of the choices (JSON string escapes are EBNF's)."""
    choices = json.loads(spec)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

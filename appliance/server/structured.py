"""From a request body's output constraint to the engine's StructuredOutputs, and the field it
came from.

Three spellings reach the same thing: OpenAI's `response_format` (json_schema, json_object,
text), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and vLLM's
older `guided_*` fields. At most one constraint may be given (a 400 naming the second). Whether
the constraint can be enforced (a schema that is valid JSON and uses only keywords the grammar
enforces, a regex or grammar that parses) is the engine's check, offline too
(engine/request_checks.py); its refusal comes back as the 400 naming the field recorded here
(`PreparedRequest.refusal`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from appliance.sampling_params import StructuredOutputs
from appliance.server.errors import bad_request

if TYPE_CHECKING:
    from appliance.server.prepare import Body


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise bad_request(f"{param}: a JSON schema must be an object", param=param)


def _from_response_format(fmt: dict[str, Any]) -> tuple[StructuredOutputs | None, str]:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputs(kind="json_object"), "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise bad_request(f"{param}: required with type json_schema", param=param)
        # vLLM's older clients send the schema as json_schema.json_schema.
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI's schema is optional: then any JSON object (a strict {"type": "object"}
            # grammar would allow only {}).
            return StructuredOutputs(kind="json_object"), param
        param += ".schema"
        return StructuredOutputs(kind="json", spec=_schema_text(schema, param)), param
    raise bad_request(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def _candidates(body: Body) -> list[tuple[StructuredOutputs, str]]:
    found: list[tuple[StructuredOutputs, str]] = []
    if body.response_format is not None:
        so, param = _from_response_format(body.response_format)
        if so is not None:
            found.append((so, param))
    so_params = body.structured_outputs
    if so_params is not None:
        p = "structured_outputs"
        if so_params.json is not None:
            found.append(
                (
                    StructuredOutputs(kind="json", spec=_schema_text(so_params.json, p + ".json")),
                    p + ".json",
                )
            )
        if so_params.regex is not None:
            found.append((StructuredOutputs(kind="regex", spec=so_params.regex), p + ".regex"))
        if so_params.choice is not None:
            found.append(
                (StructuredOutputs(kind="choice", spec=json.dumps(so_params.choice)), p + ".choice")
            )
        if so_params.grammar is not None:
            found.append(
                (StructuredOutputs(kind="grammar", spec=so_params.grammar), p + ".grammar")
            )
        if so_params.json_object:
            found.append((StructuredOutputs(kind="json_object"), p + ".json_object"))
    if body.guided_json is not None:
        found.append(
            (
                StructuredOutputs(kind="json", spec=_schema_text(body.guided_json, "guided_json")),
                "guided_json",
            )
        )
    if body.guided_regex is not None:
        found.append((StructuredOutputs(kind="regex", spec=body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append(
            (StructuredOutputs(kind="choice", spec=json.dumps(body.guided_choice)), "guided_choice")
        )
    if body.guided_grammar is not None:
        found.append(
            (StructuredOutputs(kind="grammar", spec=body.guided_grammar), "guided_grammar")
        )
    return found


def structured_outputs(body: Body) -> tuple[StructuredOutputs, str] | None:
    """The request's output constraint and the field that gave it (None: unconstrained); 400
    for a malformed or doubled one."""
    found = _candidates(body)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise bad_request(f"give at most one output constraint, got {names}", param=found[1][1])
    return found[0]

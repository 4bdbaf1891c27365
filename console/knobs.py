"""Live knobs from the console: `key = value` as the operator types it, turned into the body of
PATCH /admin/config, and the diff against the running configuration shown before it is sent."""

from __future__ import annotations

from typing import Any

from appliance.config_sources import ConfigError, parse_override_value

KNOB_PLACEHOLDER = "scheduler.max_num_seqs = 8"


def parse_knobs(line: str) -> dict[str, Any]:
    """`a.b = 1, c.d.e = 2` -> {"a.b": 1, "c.d.e": 2}; ConfigError naming what is wrong."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in line.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not value.strip() or key.count(".") not in (1, 2):
            raise ConfigError(
                f"{part!r}: expected KEY = VALUE with a dotted key, e.g. {KNOB_PLACEHOLDER}"
            )
        out[key] = parse_override_value(value.strip())
    if not out:
        raise ConfigError(f"nothing to change: expected KEY = VALUE, e.g. {KNOB_PLACEHOLDER}")
    return out


def patch_body(knobs: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as the nested tables PATCH /admin/config takes."""
    body: dict[str, Any] = {}
    for dotted, value in knobs.items():
        *tables, key = dotted.split(".")
        node = body
        for table in tables:
            node = node.setdefault(table, {})
        node[key] = value
    return body


def running_value(running: dict[str, Any] | None, dotted: str) -> Any:
    node: Any = (running or {}).get("config", {})
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node

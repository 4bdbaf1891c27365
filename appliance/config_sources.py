"""Where a configuration comes from: the templates (shipped, and the operator's folder beside
them) and the command line's `--set KEY=VALUE` and `--model DIR` overrides, applied to the raw
TOML tables before appliance.config validates them into its Structs."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

# Where operators keep their own templates beside the shipped ones.
TEMPLATE_DIR_ENV = "APPLIANCE_TEMPLATE_DIR"
DEFAULT_TEMPLATE_DIR = "/etc/appliance/templates"


class ConfigError(ValueError):
    """A template or override that cannot be used; the message names the key and the limit."""


def shipped_template_dir() -> Path:
    return Path(str(resources.files("appliance.templates")))


def template_dirs() -> list[Path]:
    dirs = [shipped_template_dir()]
    extra = os.environ.get(TEMPLATE_DIR_ENV, DEFAULT_TEMPLATE_DIR)
    if extra and Path(extra).is_dir():
        dirs.append(Path(extra))
    return dirs


def list_templates() -> dict[str, Path]:
    """Template name -> file, operator templates shadowing shipped ones of the same name."""
    found: dict[str, Path] = {}
    for d in template_dirs():
        for f in sorted(d.glob("*.toml")):
            found[f.stem] = f
    return found


def resolve_template(name_or_path: str | os.PathLike[str]) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"template: no such file {str(p)!r}")
        return p
    templates = list_templates()
    if str(name_or_path) not in templates:
        raise ConfigError(
            f"template: unknown template {str(name_or_path)!r}; "
            f"available: {', '.join(sorted(templates)) or 'none'}"
        )
    return templates[str(name_or_path)]


def parse_override_value(text: str) -> Any:
    """`--set key=value` values: TOML literals (numbers, booleans, arrays), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` arguments (every command that loads a template takes them)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. cache.block_size=16")
        out[key.strip()] = parse_override_value(value.strip())
    return out


def model_override(path: str) -> dict[str, Any]:
    """`--model DIR`: the model a user brings in place of the template's. Its provisioning
    (a packaged fetch, a demo build) and the name it serves under go with the template's model:
    nothing is fetched into the user's folder, and the folder's name serves. `--set` keys given
    beside it still win (callers merge them after)."""
    return {"model.path": path, "model.name": "", "model.packaged": "", "model.demo_shape": ""}


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    for dotted, value in (overrides or {}).items():
        parts = dotted.split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a table")
            node = child
        node[parts[-1]] = parse_override_value(value) if isinstance(value, str) else value
    return raw

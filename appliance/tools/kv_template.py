"""Write a KV keep-list into a copy of a template, keeping the operator's text and comments.

There is no TOML writer among the dependencies, and re-serialising would drop the comments that
explain a template, so the `[cache]` table is edited as text and the result is checked by
loading it back.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from appliance.config import ConfigError, load_config

_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEYS = ("kv_cache_dtype", "kv_cache_keep_16bit", "kv_cache_keep_16bit_heads")


def _drop_keys(lines: list[str], start: int, end: int) -> list[str]:
    """Lines [start, end) of a table without its kv_cache_dtype / kv_cache_keep_16bit[_heads]
    entries (a multi-line array included)."""
    kept, skipping = [], False
    for line in lines[start:end]:
        stripped = line.strip()
        if skipping:
            skipping = "]" not in stripped.split("#")[0]
            continue
        key = stripped.split("=")[0].strip()
        if key in _KEYS:
            value = stripped.split("=", 1)[1].split("#")[0]
            skipping = "[" in value and "]" not in value
            continue
        kept.append(line)
    return kept


def write_keep_list(
    template: Path, out: Path, kv_cache_dtype: str, keep: list[int], heads: list[str] | None = None
) -> None:
    """Copy `template` to `out` with `[cache] kv_cache_dtype`, `kv_cache_keep_16bit` and (when
    given) `kv_cache_keep_16bit_heads` set."""
    heads = heads or []
    lines = template.read_text("utf-8").splitlines()
    entries = [
        f'kv_cache_dtype = "{kv_cache_dtype}"',
        f"kv_cache_keep_16bit = {keep}   # proposed by appliance kv-eval",
    ]
    if heads:
        quoted = ", ".join(f'"{h}"' for h in heads)
        entries.append(f"kv_cache_keep_16bit_heads = [{quoted}]   # proposed by appliance kv-eval")
    tables = [(i, m.group(1)) for i, line in enumerate(lines) if (m := _TABLE.match(line))]
    cache_at = next((i for i, name in tables if name == "cache"), None)
    if cache_at is None:
        new = [*lines, "", "[cache]", *entries]
    else:
        end = next((i for i, _ in tables if i > cache_at), len(lines))
        body = _drop_keys(lines, cache_at + 1, end)
        new = [*lines[: cache_at + 1], *entries, *body, *lines[end:]]
    text = "\n".join(new) + "\n"
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--write-template: could not edit {template} cleanly: {exc}") from None
    out.write_text(text, "utf-8")
    cfg = load_config(out)
    c = cfg.cache
    if (c.kv_cache_dtype, c.kv_cache_keep_16bit, c.kv_cache_keep_16bit_heads) != (
        kv_cache_dtype,
        keep,
        heads,
    ):
        raise ConfigError(f"--write-template: {out} does not read back as written")

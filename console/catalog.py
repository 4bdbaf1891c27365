"""Templates as the templates screen lists them (model, TP size, memory plan) and the diff of
one against the running configuration. No Textual here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import ApplianceConfig, ConfigError, config_to_toml_dict, load_config
from appliance.config_sources import list_templates, shipped_template_dir

try:  # the memory planner is optional for the console: without it the column says so
    from appliance import plan as _plan
except ImportError:  # pragma: no cover - depends on the checkout
    _plan = None  # type: ignore[assignment]


@dataclass
class TemplateInfo:
    name: str
    path: Path
    source: str  # shipped | operator
    config: ApplianceConfig | None
    # Why the template does not load ("" when it does).
    error: str = ""
    model: str = ""
    tp: int | None = None
    plan: str = ""


def plan_summary(cfg: ApplianceConfig, name: str) -> str:
    if _plan is None:
        return "plan unavailable"
    try:
        p = _plan.make_plan(cfg, name)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        return f"plan unavailable: {exc}"
    c = p.chosen
    if not c.weight_params:
        return c.verdict
    unit = "/GPU" if p.device == "cuda" else ""
    return f"{c.weights_bytes / 1024**3:.1f}G{unit} · {c.kv_blocks} blocks · {c.verdict}"


def model_label(cfg: ApplianceConfig) -> str:
    m = cfg.model
    return m.name or m.architecture or Path(m.path).name or "?"


def scan_templates() -> list[TemplateInfo]:
    shipped = shipped_template_dir().resolve()
    out = []
    for name, path in sorted(list_templates().items()):
        source = "shipped" if path.resolve().parent == shipped else "operator"
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            out.append(TemplateInfo(name, path, source, None, error=str(exc), model="invalid"))
            continue
        out.append(
            TemplateInfo(
                name,
                path,
                source,
                cfg,
                model=model_label(cfg),
                tp=cfg.parallel.tensor_parallel_size,
                plan=plan_summary(cfg, name),
            )
        )
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


MISSING = object()


def config_diff(template: ApplianceConfig, running: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, running value, template value) for every setting that would change."""
    new = flatten(config_to_toml_dict(template))
    old = flatten(running)
    keys = sorted(set(new) | set(old))
    return [
        (k, old.get(k, MISSING), new.get(k, MISSING))
        for k in keys
        if old.get(k, MISSING) != new.get(k, MISSING)
    ]


def show_value(v: Any) -> str:
    return "(absent)" if v is MISSING else repr(v) if isinstance(v, str) else str(v)


def is_running(info: TemplateInfo, running_template: str | None, running_path: str) -> bool:
    if running_template is None:
        return False
    if running_template == info.name:
        return True
    try:
        return bool(running_path) and Path(running_path).resolve() == info.path.resolve()
    except OSError:
        return False

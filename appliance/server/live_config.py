"""Live knobs: the part of a template the engine core can change between two steps.

`PATCH /admin/config` takes a body shaped like the template's own tables, e.g.
`{"scheduler": {"max_num_seqs": 8}, "priority_classes": {"batch": {"queue_timeout_s": 60}}}`,
and `plan_change` turns it into the new whole config and its diff, or refuses it naming the key:

- 400: a key no template has, a value of the wrong type or outside the template's range, or a
  combination the template would refuse (config.py's consistency checks run on the result);
- 409: a key the template has but that needs a new engine (KV size, dtype, model, a class's
  priority, the scheduling policy): `POST /admin/reload` (a template apply) is the way.

Raising `max_num_seqs` or `max_num_batched_tokens` above the values the running engine was
built with is a 409 too: its memory profile and warm-up were sized for those (on a GPU the KV
pool is what the profile left over), so more needs a rebuild. Lowering is always live.
Torch-free; nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from appliance.config import (
    ApplianceConfig,
    ConfigError,
    Fraction,
    NonNegFloat,
    NonNegInt,
    PositiveInt,
    PriorityClass,
    SchedulerConfig,
    config_from_dict,
)

PositiveFloatOrNone = Annotated[float, Meta(gt=0.0)] | None


class SchedulerKnobs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """[scheduler] keys the core applies at its next step boundary (config.py documents each)."""

    max_num_seqs: PositiveInt | UnsetType = UNSET
    max_num_batched_tokens: PositiveInt | UnsetType = UNSET
    long_prefill_token_threshold: NonNegInt | UnsetType = UNSET
    preemption_mode: Literal["recompute", "swap"] | UnsetType = UNSET
    preemption_threshold: Fraction | UnsetType = UNSET
    # The thrash guard.
    preemption_patience_steps: PositiveInt | UnsetType = UNSET
    max_preemptions_per_request: PositiveInt | UnsetType = UNSET
    max_waiting_requests: NonNegInt | UnsetType = UNSET
    queue_timeout_s: NonNegFloat | UnsetType = UNSET
    estimated_wait_admission: bool | UnsetType = UNSET


class ClassKnobs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A [priority_classes.NAME] table's live keys; null clears an SLO target."""

    queue_timeout_s: NonNegFloat | UnsetType = UNSET
    max_waiting_requests: NonNegInt | UnsetType = UNSET
    tpot_slo_ms: PositiveFloatOrNone | UnsetType = UNSET
    ttft_slo_s: PositiveFloatOrNone | UnsetType = UNSET
    ttft_goal_s: PositiveFloatOrNone | UnsetType = UNSET
    tpot_ceiling_ms: PositiveFloatOrNone | UnsetType = UNSET


class LivePatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    scheduler: SchedulerKnobs | UnsetType = UNSET
    priority_classes: dict[str, ClassKnobs] | UnsetType = UNSET


# Keys that only grow with a rebuild: their ceiling is the running engine's own value.
SIZED_AT_LOAD = ("max_num_seqs", "max_num_batched_tokens")
RELOAD_HINT = (
    "needs a new engine: apply a template (POST /admin/reload, or the console's templates)"
)


class LiveConfigError(ValueError):
    """A refused change; nothing was changed. `status` is 400 or 409, `key` the dotted key."""

    def __init__(self, status: int, key: str, message: str) -> None:
        super().__init__(message)
        self.status, self.key = status, key


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any


@dataclass(frozen=True)
class PlannedChange:
    config: ApplianceConfig
    changes: list[Change]

    def diff(self) -> list[dict[str, Any]]:
        return [{"key": c.key, "before": c.before, "after": c.after} for c in self.changes]

    def overrides(self) -> dict[str, Any]:
        """The change as dotted `--set` keys (a SIGHUP reload of the same template keeps it)."""
        return {c.key: c.after for c in self.changes}


def _fields(struct: type[msgspec.Struct]) -> set[str]:
    return set(struct.__struct_fields__)


def _check_keys(raw: Any, current: ApplianceConfig) -> None:
    """Unknown keys (400) and keys that need a rebuild (409), before any value is read."""
    if not isinstance(raw, dict):
        raise LiveConfigError(400, "", "the body must be a JSON object of template tables")
    live_sched, live_class = _fields(SchedulerKnobs), _fields(ClassKnobs)
    for section, value in raw.items():
        if section not in _fields(ApplianceConfig):
            raise LiveConfigError(400, section, f"{section}: no such template key")
        if section == "scheduler" and isinstance(value, dict):
            for key in value:
                _check_key(f"scheduler.{key}", key in live_sched, key in _fields(SchedulerConfig))
        elif section == "priority_classes" and isinstance(value, dict):
            for name, table in value.items():
                if name not in current.priority_classes:
                    known = ", ".join(sorted(current.priority_classes)) or "none"
                    raise LiveConfigError(
                        400,
                        f"priority_classes.{name}",
                        f"priority_classes.{name}: unknown class (known: {known}); adding a "
                        f"class {RELOAD_HINT}",
                    )
                for key in table if isinstance(table, dict) else ():
                    dotted = f"priority_classes.{name}.{key}"
                    _check_key(dotted, key in live_class, key in _fields(PriorityClass))
        elif section not in ("scheduler", "priority_classes"):
            first = next(iter(value), "") if isinstance(value, dict) and value else ""
            dotted = f"{section}.{first}" if first else section
            raise LiveConfigError(409, dotted, f"{dotted}: {RELOAD_HINT}")


def _check_key(dotted: str, live: bool, known: bool) -> None:
    if not known:
        raise LiveConfigError(400, dotted, f"{dotted}: no such template key")
    if not live:
        raise LiveConfigError(409, dotted, f"{dotted}: {RELOAD_HINT}")


def _convert(value: Any, struct: type[Any], prefix: str) -> Any:
    try:
        return msgspec.convert(value, struct)
    except msgspec.ValidationError as exc:
        text = str(exc)
        # msgspec names the path inside `value` as "$.max_num_seqs": prefix it to a dotted key.
        inner = text.rpartition("`$")[2].rstrip("`").lstrip(".") if "`$" in text else ""
        key = ".".join(part for part in (prefix, inner) if part)
        raise LiveConfigError(400, key, f"{key}: {text.partition(' - at ')[0]}") from None


def _decode(raw: dict[str, Any]) -> LivePatch:
    """Each table on its own, so that an error names the class by its name."""
    out = LivePatch()
    if "scheduler" in raw:
        out.scheduler = _convert(raw["scheduler"], SchedulerKnobs, "scheduler")
    if "priority_classes" in raw:
        tables = _convert(raw["priority_classes"], dict[str, dict[str, Any]], "priority_classes")
        out.priority_classes = {
            name: _convert(table, ClassKnobs, f"priority_classes.{name}")
            for name, table in tables.items()
        }
    return out


def _set_values(struct: msgspec.Struct) -> dict[str, Any]:
    return {
        name: getattr(struct, name)
        for name in struct.__struct_fields__
        if getattr(struct, name) is not UNSET
    }


def plan_change(raw: Any, current: ApplianceConfig, loaded: ApplianceConfig) -> PlannedChange:
    """The whole config after `raw` (a decoded JSON body) and what changed; LiveConfigError
    when any part is refused. `loaded` is the config the running engine was built with."""
    _check_keys(raw, current)
    patch = _decode(raw)
    tree = msgspec.to_builtins(current)
    wanted: dict[str, Any] = {}
    if patch.scheduler is not UNSET:
        for key, value in _set_values(patch.scheduler).items():
            wanted[f"scheduler.{key}"] = value
            tree["scheduler"][key] = value
    if patch.priority_classes is not UNSET:
        for name, knobs in patch.priority_classes.items():
            for key, value in _set_values(knobs).items():
                wanted[f"priority_classes.{name}.{key}"] = value
                tree["priority_classes"][name][key] = value
    for key in SIZED_AT_LOAD:
        value, ceiling = wanted.get(f"scheduler.{key}"), getattr(loaded.scheduler, key)
        if value is not None and value > ceiling:
            raise LiveConfigError(
                409,
                f"scheduler.{key}",
                f"scheduler.{key}: {value} is above {ceiling}, the value the running engine "
                f"was built with (its memory profile and warm-up were sized for it); more "
                f"{RELOAD_HINT}",
            )
    try:
        new = config_from_dict(tree, "PATCH /admin/config")
    except ConfigError as exc:
        # The key the error names (a ceiling below its target), else the patch's first.
        named = [key for key in wanted if key in str(exc)]
        raise LiveConfigError(400, (named or [*wanted, ""])[0], str(exc)) from None
    before = msgspec.to_builtins(current)
    after = msgspec.to_builtins(new)
    changes = [
        Change(key, _lookup(before, key), _lookup(after, key))
        for key in wanted
        if _lookup(before, key) != _lookup(after, key)
    ]
    return PlannedChange(new, changes)


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_diff(before: ApplianceConfig, after: ApplianceConfig) -> list[dict[str, Any]]:
    """Every dotted key whose value differs (a template apply's diff, for the audit log)."""
    old, new = _flatten(msgspec.to_builtins(before)), _flatten(msgspec.to_builtins(after))
    return [
        {"key": key, "before": old.get(key), "after": new.get(key)}
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]

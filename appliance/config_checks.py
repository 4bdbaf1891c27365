"""Configuration checks across fields: what msgspec's per-field validation (appliance.config)
cannot see, such as a class named by the scheduler but not defined, or a TPOT ceiling below its
target."""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.config_sources import ConfigError

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig


def check_consistency(cfg: ApplianceConfig, source: str) -> None:
    """The checks that span fields, after msgspec has validated each one: a ConfigError naming
    the key and the limit (`source`: the template or request the values came from)."""
    s = cfg.scheduler
    if s.long_prefill_token_threshold > s.max_num_batched_tokens:
        raise ConfigError(
            f"{source}: scheduler.long_prefill_token_threshold ({s.long_prefill_token_threshold}) "
            f"must not exceed scheduler.max_num_batched_tokens ({s.max_num_batched_tokens})"
        )
    if s.default_priority_class and s.default_priority_class not in cfg.priority_classes:
        known = ", ".join(sorted(cfg.priority_classes)) or "none"
        raise ConfigError(
            f"{source}: scheduler.default_priority_class {s.default_priority_class!r} is not a "
            f"class in [priority_classes] (known: {known})"
        )
    if s.long_prompt_class and s.long_prompt_class not in cfg.priority_classes:
        known = ", ".join(sorted(cfg.priority_classes)) or "none"
        raise ConfigError(
            f"{source}: scheduler.long_prompt_class {s.long_prompt_class!r} is not a class in "
            f"[priority_classes] (known: {known})"
        )
    if bool(s.long_prompt_class) != bool(s.long_prompt_tokens):
        raise ConfigError(
            f"{source}: scheduler.long_prompt_tokens ({s.long_prompt_tokens}) and "
            f"scheduler.long_prompt_class ({s.long_prompt_class!r}) are set together: "
            "long_prompt_tokens >= 1 and a class name, or neither"
        )
    for name, cls in cfg.priority_classes.items():
        ceiling = cls.tpot_ceiling_ms
        if ceiling is not None and (cls.tpot_slo_ms is None or ceiling < cls.tpot_slo_ms):
            raise ConfigError(
                f"{source}: priority_classes.{name}.tpot_ceiling_ms ({ceiling}) stretches the "
                f"class's tpot_slo_ms ({cls.tpot_slo_ms}): set that target, and a ceiling at "
                "or above it"
            )
    cache = cfg.cache
    if cache.kv_cache_scales == "per_token" and cache.kv_cache_dtype != "int8":
        raise ConfigError(
            f'{source}: cache.kv_cache_scales = "per_token" needs cache.kv_cache_dtype = "int8" '
            f"(not {cache.kv_cache_dtype!r}): FP8's error is relative, per-token scales do not "
            "help it, and a 16-bit cache has no scales"
        )
    if len(set(cache.kv_cache_keep_16bit)) != len(cache.kv_cache_keep_16bit):
        raise ConfigError(f"{source}: cache.kv_cache_keep_16bit lists a layer twice")
    try:
        heads = cache.kept_heads()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    for entry, (layer, head) in zip(cache.kv_cache_keep_16bit_heads, heads, strict=True):
        if heads.count((layer, head)) > 1:
            raise ConfigError(f"{source}: cache.kv_cache_keep_16bit_heads lists {entry!r} twice")
        if layer in cache.kv_cache_keep_16bit:
            raise ConfigError(
                f"{source}: cache.kv_cache_keep_16bit_heads: {entry!r} is in layer {layer}, "
                "which cache.kv_cache_keep_16bit already keeps whole"
            )

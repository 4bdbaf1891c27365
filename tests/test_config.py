"""Templates validate into Structs; unknown keys and bad values are errors naming them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.config import (
    ClassLimits,
    ConfigError,
    load_config,
    served_model_name,
)
from appliance.config_sources import list_templates


def test_every_shipped_template_validates() -> None:
    templates = list_templates()
    assert "cpu-demo" in templates
    for name in templates:
        load_config(name)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache]\nblock_sise = 16\n")
    with pytest.raises(ConfigError, match=r"block_sise.*\$\.cache"):
        load_config(bad)


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("scheduler.max_num_seqs", 0, r"max_num_seqs"),
        ("cache.block_size", 1000, r">= 1|<= 256"),
        ("cache.gpu_memory_utilization", 1.5, r"gpu_memory_utilization"),
        ("cache.kv_cache_dtype", "fp4", r"kv_cache_dtype"),
        ("scheduler.policy", "random", r"policy"),
        ("parallel.tensor_parallel_size", 3, r"tensor_parallel_size"),
        # ideep crashes on an empty cache; below 8 a step's own shapes evict each other.
        ("hardware.onednn_cache_capacity", 0, r"onednn_cache_capacity"),
        ("hardware.onednn_cache_capacity", 4, r"onednn_cache_capacity"),
        ("hardware.heap_trim_interval_s", -1.0, r"heap_trim_interval_s"),
    ],
)
def test_bad_values_name_the_field(key: str, value: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config("cpu-demo", {key: value})


def test_overrides_parse_like_the_cli() -> None:
    cfg = load_config(
        "cpu-demo", {"cache.block_size": "32", "cache.enable_prefix_caching": "false"}
    )
    assert cfg.cache.block_size == 32
    assert cfg.cache.enable_prefix_caching is False


def test_unknown_template_lists_available() -> None:
    with pytest.raises(ConfigError, match="cpu-demo"):
        load_config("no-such-template")


def test_priority_classes() -> None:
    cfg = load_config("cpu-demo")
    assert cfg.priority_of("realtime") < cfg.priority_of("batch")
    assert cfg.priority_of(3) == 3
    assert cfg.class_of(cfg.priority_of("batch")) == "batch"
    with pytest.raises(ConfigError, match="unknown class 'vip'"):
        cfg.priority_of("vip")


def test_a_request_without_priority_takes_the_default_class() -> None:
    cfg = load_config("cpu-demo")
    assert cfg.default_class() == "interactive"
    assert cfg.priority_of(None) == cfg.priority_of("interactive")
    # Classes without an "interactive" one: the most urgent, as before the setting existed.
    own = load_config(None, {"priority_classes": {"rt": {"priority": 0}, "bulk": {"priority": 9}}})
    assert own.default_class() == "rt" and own.priority_of(None) == 0
    fast_fail = load_config("cpu-demo", {"scheduler.default_priority_class": "realtime"})
    assert fast_fail.priority_of(None) == fast_fail.priority_of("realtime")


def test_the_default_class_must_exist() -> None:
    with pytest.raises(ConfigError, match=r"scheduler.default_priority_class 'vip' is not a class"):
        load_config("cpu-demo", {"scheduler.default_priority_class": "vip"})


def test_class_limits_take_the_class_value_else_the_scheduler_default() -> None:
    classes = {
        f"priority_classes.{name}.priority": p
        for name, p in (("realtime", 0), ("interactive", 5), ("batch", 10))
    }
    cfg = load_config(
        None,
        {
            "scheduler.max_waiting_requests": 7,
            "scheduler.queue_timeout_s": 2.0,
            **classes,
            "priority_classes.batch.max_waiting_requests": 3,
        },
    )
    assert cfg.class_limits("batch") == ClassLimits(max_waiting_requests=3, queue_timeout_s=2.0)
    assert cfg.class_limits("realtime") == ClassLimits(max_waiting_requests=7, queue_timeout_s=2.0)
    # An integer priority's counter class (e.g. "3") has no class table: the defaults apply.
    assert cfg.class_limits("3") == ClassLimits(max_waiting_requests=7, queue_timeout_s=2.0)
    assert cfg.resolve_priority("batch") == (10, "batch")
    assert cfg.resolve_priority(6) == (6, "interactive")
    assert cfg.resolve_priority(None) == (5, "interactive")  # scheduler.default_priority_class


def test_fcfs_is_read_as_continuous_one_name_inside() -> None:
    assert load_config(None, {"scheduler.policy": "fcfs"}).scheduler.policy == "continuous"
    assert load_config(None, {"scheduler.policy": "priority"}).scheduler.policy == "priority"


def test_served_name_rule(tmp_path: Path) -> None:
    cfg = load_config(None, {"model.path": str(tmp_path / "Llama-2-13b-chat-hf")})
    assert served_model_name(cfg) == "Llama-2-13b-chat-hf"
    # Once the engine resolved the directory, its name counts (a demo model built elsewhere).
    assert served_model_name(cfg, tmp_path / "built") == "built"
    named = load_config(None, {"model.path": str(tmp_path / "x"), "model.name": "chat"})
    assert served_model_name(named, tmp_path / "built") == "chat"


def test_engine_threads_field_sets_the_core_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.engine.core_process import core_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert core_threads(3) == 3  # the config field wins
    assert core_threads(0) is None  # OMP_NUM_THREADS: torch's own choice
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert core_threads(0) == len(os.sched_getaffinity(0))  # every core (measured over HTTP)
    assert load_config(None, {"hardware.engine_threads": 1}).hardware.engine_threads == 1


def test_a_model_the_user_brings_drops_the_templates_provisioning_and_name() -> None:
    """`--model DIR` on cpu-demo: no SmolLM2 fetch into the user's folder, and the folder's name
    serves rather than "SmolLM2-135M-Instruct"; a --set beside it still wins."""
    from appliance.config_sources import model_override

    cfg = load_config("cpu-demo", model_override("/models/mine"))
    assert (cfg.model.path, cfg.model.name, cfg.model.packaged) == ("/models/mine", "", "")
    named = load_config("cpu-demo", {**model_override("/models/mine"), "model.name": "mine"})
    assert named.model.name == "mine"
    assert load_config("cpu-bench", model_override("/m")).model.demo_shape == ""

"""Which executor loads and runs the model: this process alone, or a tensor-parallel group.

Kept apart from the loader so that the TP driver and its workers can call the single-rank load
(`loader.load_this_rank`) without the loader importing them back.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.config import ApplianceConfig
from appliance.engine.loader import LoadedModel, load_this_rank
from appliance.layers.parallel import tp_size


def load_model(
    config: ApplianceConfig, progress: Callable[[str], None] | None = None
) -> LoadedModel:
    """Load the model the config names, ready to execute steps.

    With `parallel.tensor_parallel_size` > 1 this process becomes rank 0 of a TP group: the
    executor spawns the other ranks, each loads its shard, and `LoadedModel.executor` drives
    them all each step (appliance.engine.tp).
    """
    if config.parallel.tensor_parallel_size > 1 and tp_size() == 1:
        from appliance.engine.tp import TPExecutor

        loaded = TPExecutor.start(config, progress).loaded
        assert loaded is not None  # start() returns once every rank has loaded
        return loaded
    return load_this_rank(config, progress)

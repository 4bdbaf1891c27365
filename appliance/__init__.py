"""appliance: a single-node LLM inference appliance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance.kernels.cpu_features import limit_onednn_to_mask

# Before torch loads: a CPU feature mask applies to oneDNN's kernels too.
limit_onednn_to_mask()

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams"]

if TYPE_CHECKING:
    from appliance.engine.llm_engine import Engine
    from appliance.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: `import appliance.config` (CLI, console) must not pay for importing torch.
    if name == "Engine":
        from appliance.engine.llm_engine import Engine

        return Engine
    if name == "SamplingParams":
        from appliance.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

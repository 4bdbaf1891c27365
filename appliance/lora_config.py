"""The `[lora]` section of a template: LoRA adapters in the PEFT format (docs/lora.md). Its own
module so that config.py stays under 500 lines; config.py holds it as `ApplianceConfig.lora`."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """[lora]: fine-tunes of the base model in the PEFT format, chosen per request by `model`."""

    # Adapter name -> directory (adapter_config.json + adapter_model.safetensors), loaded at start.
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    # Serve adapters at all (on when `adapters` names any): the slot pool exists from load on.
    enabled: bool = False
    # Adapters resident on the device at once (the slot pool); more may be loaded, LRU-swapped.
    max_loras: Annotated[int, Meta(ge=1, le=64)] = 4
    # The largest rank a slot holds; a higher-rank adapter is refused at load.
    max_lora_rank: Annotated[int, Meta(ge=1, le=256)] = 16

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.adapters)

"""A request as the scheduler sees it: token ids, progress, state, and the KV blocks it holds.
Plain Python, no tensors. The one record of a request in the engine: the scheduler's queues
and the KV cache manager both work on it, so finishing it leaves nothing behind."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from appliance.sampling_params import SamplingParams

if TYPE_CHECKING:
    from appliance.core.block_pool import KVBlock
    from appliance.core.spec_decode import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Preempted by recompute: back in the waiting queue, blocks freed.
    PREEMPTED = "preempted"
    # Preempted by swap: blocks copied to the host swap pool.
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # Admission control: the API maps these to HTTP 429.
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    # The class's ttft_slo_s would be missed by the engine's estimate (core/ttft_estimate.py).
    TTFT_SLO = "ttft_slo"
    # The request can never fit (e.g. needs more KV blocks than the whole pool).
    ERROR = "error"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The model's end-of-sequence ids; with the request's own stop ids they make up
    # stop_token_ids, the one set the scheduler stops on and the sampler bans under min_tokens.
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    priority_class: str = ""
    # The LoRA adapter it runs under ("": the base model); keys its prefix cache entries too.
    lora_name: str = ""
    arrival_time: float = field(default_factory=time.monotonic)

    # Prompt + generated tokens; the scheduler appends sampled tokens here.
    token_ids: list[int] = field(init=False)
    # Tokens whose KV is in the cache (prefix hits included).
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_detail: str = ""

    num_preemptions: int = 0
    preempted_at: float | None = None
    # Decode steps in a row it waited out (scheduler.defer_untimed_decodes): at most one.
    decode_deferrals: int = 0
    time_preempted: float = 0.0
    first_scheduled_time: float | None = None
    # Prompt logprobs handed out so far: entries for prompt positions 1 .. this (the engine
    # advances it; the scheduler asks the runner for the rest).
    num_prompt_logprobs: int = 0

    # The KV cache manager's bookkeeping (block ids, never tensors): the device blocks in table
    # order, the hash chain of the full blocks, how many leading blocks are registered in the
    # prefix cache, the tokens the allocation covers, and the host swap blocks while swapped.
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_allocated_tokens: int = 0
    swap_blocks: list[int] = field(default_factory=list)
    # What the runner holds of the block table: whether it has one, and how many ids long.
    table_sent: bool = False
    num_block_ids_sent: int = 0
    # Speculative decoding: the n-gram index over token_ids and the acceptance history
    # (core/spec_decode.py; None until the request first looks for drafts).
    spec: SpecState | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        self.stop_token_ids: frozenset[int] = eos | frozenset(params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.num_prompt_logprobs < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first: more urgent, then earlier."""
        return (self.priority, self.arrival_time)

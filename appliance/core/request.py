"""A request as the scheduler sees it: token ids, progress, state. Plain Python, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from appliance.sampling_params import SamplingParams


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
    # The request can never fit (e.g. needs more KV blocks than the whole pool).
    ERROR = "error"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    priority_class: str = ""
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
    time_preempted: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first: more urgent, then earlier."""
        return (self.priority, self.arrival_time)

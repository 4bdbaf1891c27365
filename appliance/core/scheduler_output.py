"""What one scheduler step decided, as the model runner (and TP workers, over msgpack) read it:
per request the tokens to run and the blocks added since the last step; the swaps; the tables
and matchers to drop. Block ids and token ids only, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    # Tokens fed this step: positions start_pos .. start_pos + len(token_ids) - 1.
    token_ids: list[int]
    start_pos: int
    # Block ids the runner appends to the request's block table; with new_table, the whole
    # table (a request the runner has not seen since it was admitted or resumed).
    block_ids: list[int]
    # True when this step reaches the request's last known token: sample its next one.
    sample: bool
    sampling_params: SamplingParams
    # Index of the token to be sampled among the outputs (seeds randomness per position).
    output_index: int
    new_table: bool = True
    # The request's stop tokens (Request.stop_token_ids): banned until min_tokens are out.
    stop_token_ids: frozenset[int] = frozenset()
    # Prompt logprobs wanted this step: the hidden state at position p predicts token p + 1,
    # for p = prompt_logprobs_start .. + len(targets) - 1; targets are those next tokens.
    prompt_logprobs_start: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # Speculative decoding: drafted tokens, the last len(draft_token_ids) of token_ids (after the
    # request's last known token). The runner samples at each of their positions and returns
    # the drafts that match (RunnerOutput.accepted); `sample` is then True.
    draft_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter and the device slot it runs in ("", -1: the base model); the runner
    # copies the adapter in when the slot holds another (core/lora_slots.py).
    lora_name: str = ""
    lora_slot: int = -1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # Tokens of context the step's attention reads (cached prefixes + new tokens).
    num_context_tokens: int = 0
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests whose block table the runner drops before this step: finished, preempted or
    # swapped out since the last step (a resumed one comes back with a new table).
    finished_request_ids: list[str] = field(default_factory=list)
    # Constrained requests finished since the last step: the runner drops their matchers
    # (a preempted request keeps its matcher; it is not listed here).
    done_request_ids: list[str] = field(default_factory=list)
    # Which limit stopped the step from doing more: none | token_budget | time_budget |
    # max_num_seqs | kv_blocks | lora_slots
    bound_by: str = "none"
    # Set where the step left the running decodes out to run while it is paused
    # (scheduler.interleave_decodes): they are owed a token every this many seconds.
    decode_interval_s: float | None = None

    def request_ids(self) -> frozenset[str]:
        return frozenset(r.request_id for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in

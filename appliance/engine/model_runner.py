"""Turns a SchedulerOutput into tensors, runs one forward pass and the sampler.

Owns the KV tensors (device pool and host swap pool). Token order in a step: decodes first,
then prefill chunks, so attention runs as at most two batched calls per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.step_cost import StepShape
from appliance.engine.guided import GuidedDecoder
from appliance.engine.kv_pool import KVCachePool
from appliance.engine.lora_pool import LoraSlotPool
from appliance.engine.pooling import PooledChunk, pool_chunks
from appliance.engine.sampler import Sampler, SampleRequest, TokenLogprobs
from appliance.engine.spec_verify import as_decode_rows, chunks_as_decode_rows, sample_verified
from appliance.layers.attention import AttentionMetadata, PagedBatch
from appliance.layers.lora import LoraLayerFactors
from appliance.models.llama import ForwardState, LlamaForCausalLM


@dataclass
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    # Per request: (first prompt position, logprobs of the tokens after it, in order).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: per drafting request, the drafts accepted before its sampled token
    # (a prefix of its draft_token_ids, possibly empty) and their logprobs.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Embedding requests: each one's chunk of pooled hidden states (engine/pooling.py).
    pooled: dict[str, PooledChunk] = field(default_factory=dict)


@dataclass
class _Step:
    """One step as the runner carries it from its tensors to its sampled tokens (across a
    pause, when its forward stops between two half-layers)."""

    batch: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: list[int]
    pooling: list[tuple[int, ScheduledRequest]]
    sampling: list[tuple[int, ScheduledRequest]]
    scoring: list[tuple[int, ScheduledRequest]]
    sample_rows: list[int]
    # Sampled rows, then the scored prompt rows: the rows whose logits are computed.
    row_list: list[int]
    adapters: bool
    # Its prompt chunks are fed as decode rows (StepShape.runs_as_rows).
    prompt_rows: bool = False
    forward: ForwardState | None = None


class FusedDecode(Protocol):
    """A whole decode step in one native call: (input_ids, positions, slots, block_tables,
    seq_lens, each row's LoRA slot or None) -> logits of every row."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def bind_lora(self, layers: list[LoraLayerFactors], slots: int) -> bool:
        """Add the LoRA slot pool's updates from now on; False: steps with adapter rows must
        run the torch forward."""
        ...


class ForwardHooks(Protocol):
    """What the runner asks its device backend each step (engine/backend.py's Backend is one)."""

    @property
    def fused_decode(self) -> FusedDecode | None:
        """Decode steps of up to fused_max_batch() sequences go to it (None: never)."""
        ...

    def fused_max_batch(self) -> int: ...

    def fused_prompt_rows(self) -> int:
        """Steps with a prompt's chunk go to the fused decode, the chunk as decode rows, up to
        this many rows in all (0: never)."""
        ...

    def matmuls(self, rows: int) -> AbstractContextManager[None]:
        """Around a forward of `rows` rows (a backend may switch matmul paths by width)."""
        ...


class PlainForward:
    """No fused decode, no matmul switch: the runners of calibration, profiling and the
    evaluation tools, which run the model's forward as it is."""

    fused_decode: FusedDecode | None = None

    def fused_max_batch(self) -> int:
        return 0

    def fused_prompt_rows(self) -> int:
        return 0

    def matmuls(self, rows: int) -> AbstractContextManager[None]:
        return nullcontext()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCachePool,
        block_size: int,
        device: torch.device,
        hooks: ForwardHooks | None = None,
        guided: GuidedDecoder | None = None,
        samples: bool = True,
        sampler_seed: int = 0,
        lora: LoraSlotPool | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(sampler_seed)
        # False on tensor-parallel workers: they run the forward (its collectives need every
        # rank) but only the driver samples.
        self.samples = samples
        # The backend's fused decode for small decode steps, and its matmul switch around
        # every other forward.
        self.hooks: ForwardHooks = hooks if hooks is not None else PlainForward()
        self.fused_max_batch = self.hooks.fused_max_batch()
        self.native_decode_steps = 0
        # Of those, the steps that ran a prompt's chunk as decode rows.
        self.prompt_row_steps = 0
        # A step that execute() paused between two half-layers, until resume().
        self.paused: _Step | None = None
        # Block table per live request, kept up to date from what each step changed.
        self.block_tables: dict[str, list[int]] = {}
        # Grammar matchers of constrained requests (the driver's runner only, which samples).
        self.guided = guided
        # The LoRA adapters' device slots (None: LoRA off), and whether the fused decode adds
        # their updates itself (else a step with adapter rows runs the torch forward).
        self.lora = lora
        fused = self.hooks.fused_decode
        self.fused_lora = (
            lora is not None
            and fused is not None
            and fused.bind_lora(lora.layer_factors(), lora.config.max_loras)
        )
        # A step with a prompt's chunk takes the fused decode, the chunk as decode rows, where
        # it has at most this many rows (StepShape.runs_as_rows; the scheduler's cost model
        # prices steps by the same rule). Not with adapters the fused decode does not add.
        self.fused_prompt_rows = (
            self.hooks.fused_prompt_rows() if lora is None or self.fused_lora else 0
        )

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step."""
        result = self.execute_or_pause(out, None)
        assert result is not None
        return result

    def execute_or_pause(
        self, out: SchedulerOutput, pause: Callable[[], bool] | None
    ) -> RunnerOutput | None:
        """Run one scheduled step; a step on the torch forward asks `pause` between two units
        and stops there when it says so: None comes back, the step waits in `paused` and
        `resume()` finishes it. Other steps, over other requests, may run in between (the
        engine's cut-in steps). A step with adapter rows never pauses: a step in between could
        refill one of its slots."""
        self._update_block_tables(out)
        if self.guided is not None and out.done_request_ids:
            self.guided.release(out.done_request_ids)
        self.kv.swap_out(out.blocks_to_swap_out)
        self.kv.swap_in(out.blocks_to_swap_in)
        if not out.scheduled:
            return RunnerOutput({}, {})
        step = self._plan(out)
        decode = step.meta.decode
        # A drafting request is 1 + n decode rows here (as_decode_rows): a step of drafts is
        # still a decode step, on the fused CPU decode when its rows fit; so is a step whose
        # prompt chunks were made rows.
        rows_limit = self.fused_prompt_rows if step.prompt_rows else self.fused_max_batch
        if (
            step.meta.prefill is None
            and decode is not None
            and decode.num_tokens <= rows_limit
            and not step.scoring
            and not step.pooling
            and (not step.adapters or self.fused_lora)
        ):
            return self._fused_step(step)
        step.forward = self.model.start_forward(step.input_ids, step.positions)
        return self._run_layers(step, None if step.adapters else pause)

    def resume(self, pause: Callable[[], bool] | None = None) -> RunnerOutput | None:
        """Go on with the paused step (execute_or_pause's None) from the layer it stopped at:
        its output, or None when `pause` stopped it again (it waits in `paused` once more)."""
        step, self.paused = self.paused, None
        if step is None:
            raise RuntimeError("resume() with no paused step")
        if self.lora is not None:
            self.lora.begin_step(step.batch)  # the steps in between set their own rows
        return self._run_layers(step, None if step.adapters else pause)

    def _plan(self, out: SchedulerOutput) -> _Step:
        rows = as_decode_rows(out.scheduled)
        # Only a step with a chunk (a row of several tokens after as_decode_rows) is asked.
        prompt_rows = (
            self.fused_prompt_rows > 0
            and any(len(r.token_ids) > 1 for r in rows)
            and StepShape.of(out).runs_as_rows(self.fused_prompt_rows)
        )
        if prompt_rows:
            rows = chunks_as_decode_rows(rows)
        batch = sorted(rows, key=lambda r: len(r.token_ids) > 1)
        input_ids, positions, meta, last_rows = self._prepare(batch)
        # Embedding requests are pooled, never sampled (their last chunk finishes them).
        pooling = [(i, r) for i, r in enumerate(batch) if r.sampling_params.pooling]
        sampling = [
            (i, r) for i, r in enumerate(batch) if r.sample and not r.sampling_params.pooling
        ]
        # Prompt positions whose logprobs are wanted: their rows follow the sampled ones in
        # one compute_logits call (TP ranks compute the same rows: its all-gather needs all).
        scoring = [(i, r) for i, r in enumerate(batch) if r.prompt_logprob_targets]
        first_rows = [last_rows[i] - len(r.token_ids) + 1 for i, r in enumerate(batch)]
        score_rows = [
            first_rows[i] + r.prompt_logprobs_start - r.start_pos + j
            for i, r in scoring
            for j in range(len(r.prompt_logprob_targets))
        ]
        # A drafting request samples at its last token and at each draft (spec_verify.py).
        sample_rows = [
            row
            for i, r in sampling
            for row in range(last_rows[i] - len(r.draft_token_ids), last_rows[i] + 1)
        ]
        # A step with adapter rows stays on the fused decode where it adds LoRA (fused_lora).
        adapters = self.lora is not None and self.lora.begin_step(batch)
        return _Step(
            batch, input_ids, positions, meta, last_rows, pooling, sampling, scoring,
            sample_rows, sample_rows + score_rows, adapters, prompt_rows,
        )  # fmt: skip

    def _fused_step(self, step: _Step) -> RunnerOutput:
        assert self.hooks.fused_decode is not None and step.meta.decode is not None
        lora_slots = self.lora.batch.slot_ids if step.adapters and self.lora is not None else None
        logits = self.hooks.fused_decode(
            step.input_ids,
            step.positions,
            step.meta.slot_mapping,
            step.meta.decode.block_tables,
            step.meta.decode.seq_lens,
            lora_slots,
        )
        if not step.row_list:  # nothing sampled nor scored (the load-time warm-up's steps)
            return RunnerOutput({}, {})
        # When every row is sampled, in order, the logits are used as they are (no copy).
        if step.row_list != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(step.row_list, device=self.device))
        self.native_decode_steps += 1
        self.prompt_row_steps += step.prompt_rows
        return self._sample(step, logits, {})

    def _run_layers(self, step: _Step, pause: Callable[[], bool] | None) -> RunnerOutput | None:
        assert step.forward is not None
        with self.hooks.matmuls(step.input_ids.shape[0]):
            hidden = self.model.run_layers(step.forward, step.meta, self.kv.device_caches, pause)
        if hidden is None:
            self.paused = step
            return None
        pooling, sampling, scoring = step.pooling, step.sampling, step.scoring
        pooled = pool_chunks(hidden, pooling, step.last_rows) if pooling and self.samples else {}
        if not sampling and not scoring:
            return RunnerOutput({}, {}, pooled=pooled)
        rows = torch.tensor(step.row_list, device=self.device)
        with self.hooks.matmuls(len(step.row_list)):
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return self._sample(step, logits, pooled)

    def _sample(
        self, step: _Step, logits: torch.Tensor, pooled: dict[str, PooledChunk]
    ) -> RunnerOutput:
        sampling, scoring, sample_rows = step.sampling, step.scoring, step.sample_rows
        # TP workers ran the forward and the logits' all-gather with the driver; it samples.
        if not self.samples or (not sampling and not scoring):
            return RunnerOutput({}, {})
        logits = logits.cpu()
        result = RunnerOutput({}, {}, pooled=pooled)
        if scoring:
            result.prompt_logprobs = _prompt_logprobs(logits[len(sample_rows) :], scoring)
        if not sampling:
            return result
        logits = logits[: len(sample_rows)]
        if len(sample_rows) > len(sampling):
            verified = sample_verified(self.sampler, self.guided, logits, [r for _, r in sampling])
            result.sampled, result.logprobs = verified.sampled, verified.logprobs
            result.accepted = verified.accepted
            result.accepted_logprobs = verified.accepted_logprobs
            return result
        requests = [self._sample_request(r) for _, r in sampling]
        constrained = [
            (r.request_id, r.sampling_params.structured, r.output_index)
            if r.sampling_params.structured is not None
            else None
            for _, r in sampling
        ]
        grammar = None
        if any(c is not None for c in constrained):
            if self.guided is None:
                raise RuntimeError("a constrained request reached a runner without a GuidedDecoder")
            grammar = self.guided.bitmask(constrained)
        tokens, logprobs = self.sampler(logits, requests, grammar)
        for spec, token in zip(constrained, tokens, strict=True):
            if spec is not None and self.guided is not None:
                self.guided.accept(spec[0], token)
        result.sampled = {r.request_id: t for (_, r), t in zip(sampling, tokens, strict=True)}
        result.logprobs = {
            r.request_id: lp
            for (_, r), lp in zip(sampling, logprobs, strict=True)
            if lp is not None
        }
        return result

    def _update_block_tables(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.block_tables.pop(request_id, None)
        for r in out.scheduled:
            if r.new_table:
                self.block_tables[r.request_id] = list(r.block_ids)
            else:
                self.block_tables[r.request_id].extend(r.block_ids)

    def _sample_request(self, req: ScheduledRequest) -> SampleRequest:
        params = req.sampling_params
        banned: list[int] = []
        if req.output_index < params.min_tokens:
            banned = sorted(req.stop_token_ids)
        return SampleRequest(params, req.output_index, banned)

    def _prepare(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        if all(len(r.token_ids) == 1 for r in batch):
            return self._prepare_decodes(batch)
        return self._prepare_mixed(batch)

    def _prepare_mixed(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Index arithmetic in numpy, one thread: ~25 small torch operations here each opened
        a parallel region, and on a 2-core box whose other core runs the API process a region
        waits for its second thread to be scheduled (docs/benchmarks.md, "Host time")."""
        bs, n = self.block_size, len(batch)
        query_lens = np.fromiter((len(r.token_ids) for r in batch), np.int64, n)
        starts = np.fromiter((r.start_pos for r in batch), np.int64, n)
        q_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=q_start[1:])
        num_tokens = int(q_start[-1])
        flat_ids = np.fromiter((t for r in batch for t in r.token_ids), np.int64, num_tokens)
        seq_index = np.repeat(np.arange(n), query_lens)
        positions = starts[seq_index] + (np.arange(num_tokens) - q_start[:-1][seq_index])

        rows = [self.block_tables[r.request_id] for r in batch]
        tables = np.zeros((n, max(len(row) for row in rows)), dtype=np.int64)
        for i, row in enumerate(rows):
            tables[i, : len(row)] = row
        slots = tables[seq_index, positions // bs] * bs + positions % bs
        seq_lens = starts + query_lens

        num_decodes = int(np.count_nonzero(query_lens == 1))
        dev = self.device

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(dev)

        def paged(lo: int, hi: int) -> PagedBatch | None:
            if lo == hi:
                return None
            qsl = q_start[lo : hi + 1] - q_start[lo]
            return PagedBatch(
                block_tables=tensor(tables[lo:hi]),
                seq_lens=tensor(seq_lens[lo:hi]),
                query_start_loc=tensor(qsl),
                max_query_len=int(query_lens[lo:hi].max()),
                max_seq_len=int(seq_lens[lo:hi].max()),
                num_tokens=int(qsl[-1]),
            )

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            decode=paged(0, num_decodes),
            prefill=paged(num_decodes, n),
        )
        last_rows = (q_start[1:] - 1).tolist()
        return tensor(flat_ids), tensor(positions), meta, last_rows

    def _prepare_decodes(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """_prepare for a step of decodes only, from Python lists: a handful of tensors instead
        of ~25 small torch operations (on a Zen 3 the general path took 0.7-0.8 ms a step of a
        one-at-a-time decode whose forward is ~9 ms)."""
        bs, dev, n = self.block_size, self.device, len(batch)
        positions = [r.start_pos for r in batch]
        rows = [self.block_tables[r.request_id] for r in batch]
        width = max(len(row) for row in rows)
        slots = [row[p // bs] * bs + p % bs for row, p in zip(rows, positions, strict=True)]
        decode = PagedBatch(
            block_tables=torch.tensor([row + [0] * (width - len(row)) for row in rows], device=dev),
            seq_lens=torch.tensor([p + 1 for p in positions], device=dev),
            query_start_loc=torch.arange(n + 1, device=dev),
            max_query_len=1,
            max_seq_len=max(positions) + 1,
            num_tokens=n,
        )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev), decode=decode, prefill=None
        )
        input_ids = torch.tensor([r.token_ids[0] for r in batch], device=dev)
        return input_ids, torch.tensor(positions, device=dev), meta, list(range(n))


def _prompt_logprobs(
    logits: torch.Tensor, scoring: list[tuple[int, ScheduledRequest]]
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Log-softmax (float32) of the scored prompt rows: each target's logprob and the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([t for _, r in scoring for t in r.prompt_logprob_targets])
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1).tolist()
    k_max = max(r.sampling_params.prompt_logprobs or 0 for _, r in scoring)
    top_vals, top_ids = logprobs.topk(max(k_max, 1), dim=-1)
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    row = 0
    for _, r in scoring:
        k = r.sampling_params.prompt_logprobs or 0
        entries = []
        for t in r.prompt_logprob_targets:
            entries.append(TokenLogprobs(t, chosen[row], top_ids_l[row][:k], top_vals_l[row][:k]))
            row += 1
        out[r.request_id] = (r.prompt_logprobs_start, entries)
    return out

"""Turns a SchedulerOutput into tensors, runs one forward pass and the sampler.

Owns the KV tensors (device pool and host swap pool). Token order in a step: decodes first,
then prefill chunks, so attention runs as at most two batched calls per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.guided import GuidedDecoder
from appliance.engine.sampler import Sampler, SampleRequest, TokenLogprobs
from appliance.layers.attention import AttentionMetadata, PagedBatch
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.cpu.backend import CpuBackend


@dataclass
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    # Per request: (first prompt position, logprobs of the tokens after it, in order).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class KVStorage:
    """What the pool allocates per layer: the cache's dtype, and how many of the layer's KV
    heads sit apart in a 16-bit side cache of `side_dtype` (cache.kv_cache_keep_16bit_heads;
    the layer's own cache then holds only the other heads), and whether the layer's INT8
    cache has per-token scales (cache.kv_cache_scales = "per_token": float16 scale caches of
    the quantized heads, [blocks, block_size, heads], beside K and V)."""

    dtypes: list[torch.dtype]
    side_heads: list[int]
    side_dtype: torch.dtype
    token_scales: list[bool] = field(default_factory=list)

    @classmethod
    def of(
        cls, dtype: torch.dtype | Sequence[torch.dtype] | KVStorage, num_layers: int
    ) -> KVStorage:
        if isinstance(dtype, KVStorage):
            return dtype
        dtypes = [dtype] * num_layers if isinstance(dtype, torch.dtype) else list(dtype)
        return cls(dtypes, [0] * len(dtypes), dtypes[0] if dtypes else torch.bfloat16)


class KVCachePool:
    """Per-layer K/V tensors of the device pool and the host swap pool: (k, v), or
    (k, v, side_k, side_v) for a layer that keeps heads apart in 16-bit, each followed by
    (k_scales, v_scales) for a layer with per-token scales (Attention.forward splits them)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | Sequence[torch.dtype] | KVStorage,
        device: torch.device,
    ) -> None:
        # One storage dtype per layer (or one for all): with kv_cache_keep_16bit some layers keep
        # the model dtype while the rest store FP8/INT8 bytes. Zeros, never empty: the torch
        # attention multiplies masked-out V rows by zero weights, and 0 * NaN garbage is NaN.
        storage = KVStorage.of(dtype, num_layers)
        if len(storage.dtypes) != num_layers or len(storage.side_heads) != num_layers:
            raise ValueError(f"KVCachePool: {len(storage.dtypes)} dtypes for {num_layers} layers")
        self.dtypes = storage.dtypes
        self.storage = storage
        token_scales = storage.token_scales or [False] * num_layers

        def layer(
            blocks: int, i: int, alloc: Callable[..., torch.Tensor]
        ) -> tuple[torch.Tensor, ...]:
            side = storage.side_heads[i]
            main = (blocks, block_size, num_kv_heads - side, head_dim)
            out: tuple[torch.Tensor, ...] = (
                alloc(main, storage.dtypes[i]),
                alloc(main, storage.dtypes[i]),
            )
            if side:
                apart = (blocks, block_size, side, head_dim)
                out += (alloc(apart, storage.side_dtype), alloc(apart, storage.side_dtype))
            if token_scales[i]:
                scales = (blocks, block_size, num_kv_heads - side)
                out += (alloc(scales, torch.float16), alloc(scales, torch.float16))
            return out

        self.device_caches = [
            layer(num_blocks, i, lambda s, dt: torch.zeros(s, dtype=dt, device=device))
            for i in range(num_layers)
        ]
        pin = device.type == "cuda"
        # Empty, not zeros: a swap block is only read after a whole device block was copied
        # into it, and untouched pages cost nothing (zero-filling took ~1 s per GiB at start).
        self.host_caches = [
            layer(num_swap_blocks, i, lambda s, dt: torch.empty(s, dtype=dt, pin_memory=pin))
            for i in (range(num_layers) if num_swap_blocks else [])
        ]

    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer's tensors (side caches included)."""
        return sum(t[0].numel() * t.element_size() for layer in self.device_caches for t in layer)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(mapping, self.device_caches, self.host_caches)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(mapping, self.host_caches, self.device_caches)

    @staticmethod
    def _copy(
        mapping: list[tuple[int, int]],
        src: list[tuple[torch.Tensor, ...]],
        dst: list[tuple[torch.Tensor, ...]],
    ) -> None:
        if not mapping:
            return
        src_ids = torch.tensor([a for a, _ in mapping])
        dst_ids = torch.tensor([b for _, b in mapping])
        # Every tensor of a layer, side caches included: a swapped block holds all its heads.
        for s_layer, d_layer in zip(src, dst, strict=True):
            for s, d in zip(s_layer, d_layer, strict=True):
                d[dst_ids.to(d.device)] = s[src_ids.to(s.device)].to(d.device)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCachePool,
        block_size: int,
        device: torch.device,
        sampler_seed: int = 0,
        cpu: CpuBackend | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(sampler_seed)
        # False on tensor-parallel workers: they run the forward (its collectives need every
        # rank) but only the driver samples.
        self.samples = True
        # The CPU backend (None on CUDA): its fused decode for small decode steps, and the
        # matmul switch around every other forward.
        self.cpu = cpu
        self.fused_max_batch = cpu.fused_max_batch() if cpu is not None else 0
        self.native_decode_steps = 0
        # Block table per live request, kept up to date from what each step changed.
        self.block_tables: dict[str, list[int]] = {}
        # Grammar matchers of constrained requests (the driver's runner only; loader.py).
        self.guided: GuidedDecoder | None = None

    def _matmuls(self, rows: int) -> AbstractContextManager[None]:
        return self.cpu.matmuls(rows) if self.cpu is not None else nullcontext()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._update_block_tables(out)
        if self.guided is not None and out.done_request_ids:
            self.guided.release(out.done_request_ids)
        self.kv.swap_out(out.blocks_to_swap_out)
        self.kv.swap_in(out.blocks_to_swap_in)
        if not out.scheduled:
            return RunnerOutput({}, {})
        batch = sorted(out.scheduled, key=lambda r: len(r.token_ids) > 1)
        input_ids, positions, meta, last_rows = self._prepare(batch)
        sampling = [(i, r) for i, r in enumerate(batch) if r.sample]
        # Prompt positions whose logprobs are wanted: their rows follow the sampled ones in
        # one compute_logits call (TP ranks compute the same rows: its all-gather needs all).
        scoring = [(i, r) for i, r in enumerate(batch) if r.prompt_logprob_targets]
        first_rows = [last_rows[i] - len(r.token_ids) + 1 for i, r in enumerate(batch)]
        score_rows = [
            first_rows[i] + r.prompt_logprobs_start - r.start_pos + j
            for i, r in scoring
            for j in range(len(r.prompt_logprob_targets))
        ]
        row_list = [last_rows[i] for i, _ in sampling] + score_rows
        decode = meta.decode
        if (
            meta.prefill is None
            and decode is not None
            and decode.num_tokens <= self.fused_max_batch
            and not scoring
        ):
            assert self.cpu is not None and self.cpu.fused_decode is not None
            logits = self.cpu.fused_decode(
                input_ids, positions, meta.slot_mapping, decode.block_tables, decode.seq_lens
            )
            # When every row is sampled, in order, the logits are used as they are (no copy).
            if row_list != list(range(logits.shape[0])):
                logits = logits.index_select(0, torch.tensor(row_list, device=self.device))
            self.native_decode_steps += 1
        else:
            with self._matmuls(input_ids.shape[0]):
                hidden = self.model(input_ids, positions, meta, self.kv.device_caches)
            if not sampling and not scoring:
                return RunnerOutput({}, {})
            rows = torch.tensor(row_list, device=self.device)
            with self._matmuls(len(row_list)):
                logits = self.model.compute_logits(hidden.index_select(0, rows))
        # TP workers ran the forward and the logits' all-gather with the driver; it samples.
        if not self.samples or (not sampling and not scoring):
            return RunnerOutput({}, {})
        logits = logits.cpu()
        result = RunnerOutput({}, {})
        if scoring:
            result.prompt_logprobs = _prompt_logprobs(logits[len(sampling) :], scoring)
        if not sampling:
            return result
        logits = logits[: len(sampling)]
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
        bs = self.block_size
        query_lens = [len(r.token_ids) for r in batch]
        starts = [r.start_pos for r in batch]
        flat_ids = [t for r in batch for t in r.token_ids]
        num_tokens = len(flat_ids)

        q_lens = torch.tensor(query_lens)
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), q_lens)
        q_start = torch.zeros(len(batch) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=q_start[1:])
        positions = torch.tensor(starts)[seq_index] + (
            torch.arange(num_tokens) - q_start[:-1][seq_index]
        )

        rows = [self.block_tables[r.request_id] for r in batch]
        max_blocks = max(len(row) for row in rows)
        tables = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows])
        slots = tables[seq_index, positions // bs] * bs + positions % bs
        seq_lens = torch.tensor(starts) + q_lens

        num_decodes = sum(1 for n in query_lens if n == 1)
        dev = self.device

        def paged(lo: int, hi: int) -> PagedBatch | None:
            if lo == hi:
                return None
            qsl = q_start[lo : hi + 1] - q_start[lo]
            return PagedBatch(
                block_tables=tables[lo:hi].to(dev),
                seq_lens=seq_lens[lo:hi].to(dev),
                query_start_loc=qsl.to(dev),
                max_query_len=max(query_lens[lo:hi]),
                max_seq_len=int(seq_lens[lo:hi].max()),
                num_tokens=int(qsl[-1]),
            )

        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            decode=paged(0, num_decodes),
            prefill=paged(num_decodes, len(batch)),
        )
        last_rows = (q_start[1:] - 1).tolist()
        return (
            torch.tensor(flat_ids, device=dev),
            positions.to(dev),
            meta,
            last_rows,
        )

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

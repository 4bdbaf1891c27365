"""Embeddings from the model's final hidden states (after the last norm), for requests whose
`SamplingParams.pooling` is set: prefill-only requests that the scheduler finishes once their
prompt is computed, without sampling a token.

A prompt may be computed in several chunks (chunked prefill), so the runner hands back, per
chunk, the sum of its rows and its last row (`PooledChunk`, float32), and the engine adds the
chunks up per request (`PoolingSums`): `last` takes the final chunk's last row, `mean` the
sum over every prompt position divided by their number. A chunk that starts at position 0 (a
first chunk, or a recompute after preemption) starts the sum afresh. Embedding requests take
no prefix-cache hits (core/step_builder.py): a cached block holds KV, not hidden states.
The vector goes out unnormalised; the API truncates it (`dimensions`) and L2-normalises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.core.scheduler_output import ScheduledRequest


@dataclass
class PooledChunk:
    start_pos: int
    num_tokens: int
    # float32 [hidden]: the chunk's rows summed, and its last row.
    row_sum: torch.Tensor
    last_row: torch.Tensor


def pool_chunks(
    hidden: torch.Tensor, pooling: list[tuple[int, ScheduledRequest]], last_rows: list[int]
) -> dict[str, PooledChunk]:
    """Per pooling request of the batch (its index in the batch, its scheduled chunk)."""
    out = {}
    for i, r in pooling:
        hi = last_rows[i] + 1
        rows = hidden[hi - len(r.token_ids) : hi].float()
        out[r.request_id] = PooledChunk(
            r.start_pos, len(r.token_ids), rows.sum(dim=0).cpu(), rows[-1].cpu()
        )
    return out


class PoolingSums:
    """The engine's running sums of the chunks pooled so far, per request id."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def add(self, chunks: dict[str, PooledChunk]) -> None:
        for rid, c in chunks.items():
            prev = self._sums.get(rid)
            if prev is None or c.start_pos == 0:
                self._sums[rid] = (c.row_sum, c.num_tokens, c.last_row)
            else:
                self._sums[rid] = (prev[0] + c.row_sum, prev[1] + c.num_tokens, c.last_row)

    def finish(self, request_id: str, kind: str, num_prompt_tokens: int) -> list[float]:
        """The request's pooled vector; its sums are dropped. Empty when its prompt was not
        all pooled (it ended without its last chunk: aborted, refused)."""
        entry = self._sums.pop(request_id, None)
        if entry is None or entry[1] != num_prompt_tokens:
            return []
        total, count, last = entry
        vector = last if kind == "last" else total / count
        return [float(x) for x in vector.tolist()]

    def drop(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sums)

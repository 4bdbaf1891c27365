"""Verification of speculative drafts after the one forward that scored them.

A drafting request's step fed its last token and n drafts: its n + 1 logits rows predict the
tokens after each. Row j is sampled exactly as a plain decode would sample output position
output_index + j (the same temperature, top-k/top-p, min_tokens ban, grammar mask and, for a
seeded request, the same per-position random numbers), and draft j is accepted when that
sample equals it; the first sample that differs (or the one after the last draft) is the
step's new token. For a draft of one token per position (a point mass, as prompt lookup
proposes) this is the speculative-sampling rule itself: accepted with probability p(d), and on
rejection a token drawn from p without d renormalised; so the output follows the model's own
distribution at temperature > 0, greedy output is token for token the same as without drafts,
and a seeded request draws the same tokens with and without speculation.

Constrained requests (structured outputs) are sampled row by row: row j's grammar mask is the
matcher's state after the tokens accepted before it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.guided import GuidedDecoder
from appliance.engine.sampler import Sampler, SampleRequest, TokenLogprobs


@dataclass
class VerifiedSamples:
    # Per request: the step's last new token (after any accepted drafts) and its logprobs.
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Per drafting request: the accepted drafts (a prefix of its drafts) and their logprobs.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def trim_forbidden_drafts(out: SchedulerOutput, guided: GuidedDecoder | None) -> None:
    """Drop each constrained request's drafts from the first one its grammar forbids, before
    the forward scores them (in place; the scheduler reads the shorter draft when it updates)."""
    if guided is None:
        return
    for r in out.scheduled:
        so = r.sampling_params.structured
        if not r.draft_token_ids or so is None:
            continue
        keep = guided.valid_draft_prefix(r.request_id, so, r.output_index, r.draft_token_ids)
        cut = len(r.draft_token_ids) - keep
        if cut:
            del r.token_ids[-cut:]
            r.draft_token_ids = r.draft_token_ids[:keep]


def as_decode_rows(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Each drafting request as 1 + n decode rows of one sequence, in order: its last token,
    then each draft, each at its own position and length. The attention writes every row's
    K/V before any row reads (the torch path writes the step's K/V first; the fused CPU decode
    stores first when rows share a sequence), so row j sees rows 0 .. j - 1 as a chunked
    prefill would, and takes the same decode path (and arithmetic) as a plain decode step. The
    last row carries the drafts; the runner samples all 1 + n rows."""
    rows: list[ScheduledRequest] = []
    for r in scheduled:
        if not r.draft_token_ids:
            rows.append(r)
            continue
        assert len(r.token_ids) == len(r.draft_token_ids) + 1, (
            "drafts follow a decode's one known token"
        )
        rows.extend(_rows(r))
    return rows


def chunks_as_decode_rows(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Each prompt chunk (after as_decode_rows: every request of several tokens) as one decode
    row per token, as as_decode_rows feeds drafts: the fused decode then runs a short prompt
    beside the decodes in one call instead of the torch forward (StepShape.runs_as_rows says
    when). Only the last row samples, where the chunk did."""
    rows: list[ScheduledRequest] = []
    for r in scheduled:
        rows.extend(_rows(r) if len(r.token_ids) > 1 else [r])
    return rows


def _rows(r: ScheduledRequest) -> list[ScheduledRequest]:
    """r's tokens as one row each, at its own position; the last keeps r's sample flag and
    drafts. The runner already holds r's block table (new_table, block_ids: none again)."""
    last = len(r.token_ids) - 1
    return [
        replace(
            r,
            token_ids=[token],
            start_pos=r.start_pos + j,
            sample=r.sample and j == last,
            draft_token_ids=r.draft_token_ids if j == last else [],
            new_table=False,
            block_ids=[],
        )
        for j, token in enumerate(r.token_ids)
    ]


def _row_request(r: ScheduledRequest, offset: int) -> SampleRequest:
    params = r.sampling_params
    index = r.output_index + offset
    banned = sorted(r.stop_token_ids) if index < params.min_tokens else []
    return SampleRequest(params, index, banned)


def _settle(
    out: VerifiedSamples,
    r: ScheduledRequest,
    tokens: list[int],
    logprobs: list[TokenLogprobs | None],
) -> None:
    drafts = r.draft_token_ids
    n = 0
    while n < len(drafts) and n < len(tokens) - 1 and tokens[n] == drafts[n]:
        n += 1
    rid = r.request_id
    out.sampled[rid] = tokens[n]
    last = logprobs[n]
    if last is not None:
        out.logprobs[rid] = last
    if drafts:
        out.accepted[rid] = drafts[:n]
        out.accepted_logprobs[rid] = [lp for lp in logprobs[:n] if lp is not None]


def sample_verified(
    sampler: Sampler,
    guided: GuidedDecoder | None,
    logits: torch.Tensor,
    sampling: list[ScheduledRequest],
) -> VerifiedSamples:
    """`logits`: 1 + len(draft_token_ids) rows per request of `sampling`, in its order."""
    out = VerifiedSamples()
    plain: list[tuple[ScheduledRequest, int]] = []
    constrained: list[tuple[ScheduledRequest, int]] = []
    row = 0
    for r in sampling:
        (plain if r.sampling_params.structured is None else constrained).append((r, row))
        row += 1 + len(r.draft_token_ids)
    if plain:
        rows = [first + j for r, first in plain for j in range(1 + len(r.draft_token_ids))]
        requests = [_row_request(r, j) for r, _ in plain for j in range(1 + len(r.draft_token_ids))]
        tokens, logprobs = sampler(logits[rows], requests)
        k = 0
        for r, _ in plain:
            width = 1 + len(r.draft_token_ids)
            _settle(out, r, tokens[k : k + width], logprobs[k : k + width])
            k += width
    for r, first in constrained:
        so = r.sampling_params.structured
        if guided is None or so is None:
            raise RuntimeError("a constrained request reached a runner without a GuidedDecoder")
        row_tokens: list[int] = []
        row_logprobs: list[TokenLogprobs | None] = []
        for j in range(1 + len(r.draft_token_ids)):
            grammar = guided.bitmask([(r.request_id, so, r.output_index + j)])
            t, lp = sampler(logits[first + j : first + j + 1], [_row_request(r, j)], grammar)
            guided.accept(r.request_id, t[0])
            row_tokens.append(t[0])
            row_logprobs.append(lp[0])
            if j == len(r.draft_token_ids) or t[0] != r.draft_token_ids[j]:
                break
        _settle(out, r, row_tokens, row_logprobs)
    return out

"""Speculative decoding's decisions in the engine core: which running decodes draft this step
and how many tokens (prompt lookup, core/ngram_proposer.py), and what a verified step leaves
behind (accepted tokens appended, the rejected tokens' KV blocks freed).

Adaptive: a decode with n drafts is 1 + n decode rows of one sequence to the model, which the
step cost model (core/step_cost.py) prices like any decode rows. A request drafts only while
its expected gain (accepted tokens, from its own acceptance rate) per second of extra step time
beats the batch's tokens per second without drafting: drafting turns itself off where a step is
bound by arithmetic (large batches) or a request's drafts keep failing, and on again when the
batch shrinks. Pure Python, no tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.core.ngram_proposer import NgramIndex, propose
from appliance.core.step_cost import StepCostModel, StepShape
from appliance.speculative_config import SpeculativeConfig
from appliance.stats import SpecDecodeStats

if TYPE_CHECKING:
    from appliance.core.request import Request

# Weight kept by a request's acceptance history at each verification: about the last 10 steps
# decide, so a request that starts quoting (or stops) is followed within a few steps.
DECAY = 0.9
# Prior of the per-token acceptance rate: one accepted and one rejected draft (0.5).
PRIOR_ACCEPTED = 1.0
PRIOR_TRIALS = 2.0


@dataclass
class SpecState:
    """One request's drafting state: its n-gram index and its recent acceptance."""

    index: NgramIndex
    # Decayed counts of accepted drafts and of drafts verified (accepted + the first rejected).
    accepted: float = 0.0
    trials: float = 0.0
    drafted_total: int = 0
    accepted_total: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Probability that a drafted token is accepted, given the ones before it were."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + (1 if accepted < drafted else 0)
        self.drafted_total += drafted
        self.accepted_total += accepted


def expected_accepted(rate: float, drafted: int) -> float:
    """Expected accepted drafts out of `drafted` when each is accepted with `rate` given that
    all before it were (verification stops at the first rejection)."""
    return sum(rate**i for i in range(1, drafted + 1))


class SpecDecoder:
    def __init__(
        self, cfg: SpeculativeConfig, max_model_len: int, fused_decode_rows: int = 0
    ) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        # A step of up to this many decode rows takes the device's fused decode, much faster a
        # row than the general path (CPU: 6 rows of a 16-bit model, 48 of a packed one).
        self.fused_decode_rows = fused_decode_rows
        self.stats = SpecDecodeStats(
            method=cfg.method, accepted_per_pos=[0] * cfg.num_speculative_tokens
        )

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def state(self, req: Request) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(NgramIndex(self.cfg.prompt_lookup_min))
        return req.spec

    def _drafts(self, req: Request) -> list[int]:
        params = req.sampling_params
        if not params.speculative:
            return []
        # Room for the drafts and the token sampled after them: within max_tokens and the
        # model's length (a draft past either could never be kept).
        room = min(
            self.cfg.num_speculative_tokens,
            params.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if room <= 0:
            return []
        return propose(req.token_ids, self.state(req).index, self.cfg.prompt_lookup_max, room)

    def plan(self, decodes: list[Request], cost: StepCostModel) -> dict[str, list[int]]:
        """Drafts per request id for this step's decode rows (absent: no drafting)."""
        stats = self.stats
        stats.decode_rows, stats.drafting_rows = len(decodes), 0
        if not self.cfg.adaptive or cost.coef is None:
            candidates = [(r, d) for r in decodes if (d := self._drafts(r))]
            if not candidates:
                stats.decision = "no match"
                return {}
            stats.decision = "on (not adaptive)" if not self.cfg.adaptive else "on (no cost model)"
            stats.drafting_rows = len(candidates)
            return {r.request_id: d for r, d in candidates}
        limit = self.fused_decode_rows
        if not decodes or (limit > 0 and len(decodes) == limit):
            # No fused-decode row to spare: nothing is looked up (below).
            stats.decision = "off: no draft can pay at this batch"
            return {}
        row_s, context_s = cost.decode_row_terms()
        context = sum(r.num_computed_tokens + 1 for r in decodes)
        base_s = cost.estimate(StepShape(decode_rows=len(decodes), decode_context=context)) or 0.0
        # Tokens per second without drafting: one per decode row.
        tokens, seconds = float(len(decodes)), base_s
        options = []
        looked_up = matched = 0
        for req in decodes:
            rate = self.state(req).acceptance_rate
            # A draft gains at most its request's rate (rate^i <= rate) and costs at least one
            # row at the request's context: where that cannot beat the batch's own rate, the
            # request is not looked up at all. The lookups and pricing of every request's drafts
            # cost tens of us a request a step, which on a batch that drafts nothing made it
            # 4-7% slower than drafting off (64 and 16 chats); the n-gram indexes catch up on
            # the tokens when lookups resume.
            first_row_s = row_s + context_s * (req.num_computed_tokens + 2)
            if rate * seconds <= tokens * first_row_s:
                continue
            looked_up += 1
            drafts = self._drafts(req)
            if not drafts:
                continue
            matched += 1
            best = self._best(req, len(drafts), tokens, seconds, row_s, context_s)
            if best is not None:
                options.append((req, drafts, best))
        if not options:
            stats.decision = (
                "off: no draft can pay at this batch"
                if not looked_up
                else ("off: drafting costs more than it gains" if matched else "no match")
            )
            return {}
        # Most tokens per extra second first; each one taken raises the bar for the next.
        options.sort(key=lambda o: o[2][0] / max(o[2][1], 1e-12), reverse=True)
        # A step the fused decode takes stays within its rows: past them every row of the step
        # takes the slower path, a jump the linear cost model does not see.
        unlimited = sum(len(d) for _, d, _ in options)
        spare = limit - len(decodes) if 0 < len(decodes) <= limit else unlimited
        chosen: dict[str, list[int]] = {}
        for req, drafts, best in options:
            if spare <= 0:
                break
            if best[2] > spare:
                capped = self._best(req, spare, tokens, seconds, row_s, context_s)
                if capped is None:
                    continue
                best = capped
            gain, extra_s, n = best
            if gain * seconds > tokens * extra_s:
                chosen[req.request_id] = drafts[:n]
                tokens += gain
                seconds += extra_s
                spare -= n
        stats.drafting_rows = len(chosen)
        stats.decision = (
            f"on: {len(chosen)}/{len(decodes)} rows, expected {tokens / seconds:.0f} vs "
            f"{len(decodes) / base_s:.0f} tok/s without"
            if chosen and base_s > 0
            else ("off: drafting costs more than it gains" if not chosen else "on")
        )
        return chosen

    def _best(
        self,
        req: Request,
        most: int,
        tokens: float,
        seconds: float,
        row_s: float,
        context_s: float,
    ) -> tuple[float, float, int] | None:
        """(expected gain, extra seconds, drafts) of the most worthwhile draft length up to
        `most` for a batch making `tokens` in `seconds` without it; None when none pays.

        Each draft is one more decode row (the runner feeds a drafting request's tokens as
        decode rows of one sequence), priced by the step cost model's row and context terms:
        draft j attends over start + j + 1 tokens."""
        rate = self.state(req).acceptance_rate
        start = req.num_computed_tokens
        best: tuple[float, float, int] | None = None
        best_net = gain = extra_s = 0.0
        for n in range(1, most + 1):
            gain += rate**n
            extra_s += row_s + context_s * (start + n + 1)
            # Worth it when it adds tokens faster than the batch makes them without drafts.
            net = gain * seconds - tokens * extra_s
            if net > best_net:
                best_net, best = net, (gain, extra_s, n)
        return best

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """One verification's result: the request's acceptance rate and the totals."""
        self.state(req).observe(drafted, accepted)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += accepted
        for pos in range(accepted):
            stats.accepted_per_pos[pos] += 1

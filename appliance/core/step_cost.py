"""What a step costs on this box: a linear model of a step's wall time, learnt online from the
engine's own steps (seeded at load by a few timed warm-up steps), that the scheduler asks how
large a prefill chunk may be for the step to finish within a class's TPOT target.

seconds ~= a + b * decode_rows + c * decode_context + d * prefill_tokens + e * prefill_pairs
           + f * [the step has prefill]

- a: the per-step cost (scheduling, the runner's preparation, sampling, host overhead);
- b: per decode row (its share of the weight reads a batch shares, the LM head row, sampling);
- c: per context token a decode row attends over (KV read);
- d: per prefill token (the matmuls);
- e: per query-key pair of a prefill chunk (its attention: a chunk of t tokens after s cached
  ones attends over t * (s + t / 2) pairs), which is what makes a late chunk of a long prompt
  slower than its first;
- f: what a step pays once for running a prefill at all. On the CPU a decode-only step of up to
  64 sequences is one fused native call (appliance/cpu/fused_decode.py) while a step with a
  chunk runs the torch forward: ~10-20 ms against ~40-50 ms before any token is computed. With
  one intercept for both, the fit split that difference between them: decode steps looked
  dearer than they are and chunks were sized as if the switch cost nothing. A short prompt's
  chunk that the fused decode runs as decode rows (StepShape.runs_as_rows: on AMX tiles a
  54-token prompt beside two chats took 22.7 ms so against 45.9 through torch) is priced and
  learnt as those rows.

Fitted by least squares, coefficients kept non-negative, over the steps of two kinds (decode-only
steps and steps with prefill, each its own sums, so a long run of decodes does not forget what
prefill costs), older steps weighing less (FORGET per step of the kind: a memory of ~2,000
steps, ~30 s of serving). A short window (128 steps a kind, as before) fitted the few shapes of
the last seconds: in a steady mix its rows and context moved together and the fit traded one
for the other (context cost 0, a lone row 16 ms against 11 measured; a replay of a served
run: docs/benchmarks.md). What a shared box's drift changes is the speed, not the shape of
the cost: each kind's estimate is scaled by a running mean (SPEED_RATE a step) of its steps'
measured / fitted ratio, which follows a box that got 2x slower within ~50 steps. Pure
Python: the core stays torch-free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from appliance.core.scheduler_output import SchedulerOutput
from appliance.sampling_params import SamplingParams

# Feature scales: each column near 1 at typical sizes, so the normal equations stay well posed.
SCALES = (1.0, 1.0, 1e-3, 1e-2, 1e-5, 1.0)
NAMES = (
    "step",
    "decode_row",
    "decode_context_token",
    "prefill_token",
    "prefill_pair",
    "prefill_step",
)
FORGET = 0.9995  # the weight a step of its kind keeps per newer step of that kind
SPEED_RATE = 0.1  # how far each step moves its kind's speed factor toward its own ratio
ERROR_WINDOW = 128  # steps of each kind the mean absolute error (a stat) is taken over
REFIT_EVERY = 8  # observations between refits (a 6x6 solve)
# Until a kind has this many steps it refits on each. Its first served steps are what the
# load-time seed's few cannot be: a summary's chunks at their real size. With a seed chunk slowed
# 0.2 s by a neighbour a 960-token chunk was priced at 13 s (0.8 s true), still 9.6 s after two
# served chunks refitting every 8 steps, 1.0 s refitting on each (tests/test_step_cost.py).
FRESH_STEPS = 32
RIDGE = 1e-6
# A chunk is never cut below this many tokens by time alone: a long prompt always progresses.
MIN_CHUNK = 16
# An interleaving step's forward runs at least this share of its decodes' interval between two
# of their steps (Scheduler.interleave_slice_s): the prefill always progresses.
MIN_SLICE_FRACTION = 0.25


def rowable(params: SamplingParams) -> bool:
    """Whether a request's prompt chunks may run as decode rows (StepShape.runs_as_rows): not
    where the prompt's positions are scored (prompt_logprobs) or pooled (embeddings), which
    read the torch forward's hidden rows."""
    return params.prompt_logprobs is None and not params.pooling


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model reads it."""

    decode_rows: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    # Whether every chunk may be fed as decode rows (rowable): none is a scored or pooled
    # prompt's.
    rowable: bool = True

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        shape = cls()
        for r in out.scheduled:
            n = len(r.token_ids)
            if n == 1 or r.draft_token_ids:
                # A drafting request runs as one decode row per token (engine/spec_verify.py).
                for j in range(n):
                    shape = shape.with_decode(r.start_pos + j)
            else:
                shape = shape.with_chunk(r.start_pos, n, rowable(r.sampling_params))
        return shape

    @classmethod
    def decoding(cls, contexts: Iterable[int]) -> StepShape:
        """A decode-only step of one row per request, each after `contexts`' computed tokens
        (what the scheduler asks a step of its running decodes to cost)."""
        shape = cls()
        for computed in contexts:
            shape = shape.with_decode(computed)
        return shape

    # The constructor, not dataclasses.replace: these run for every row of every step the
    # scheduler builds, prices and learns from (replace costs twice as much).
    def with_decode(self, start: int) -> StepShape:
        return StepShape(
            self.decode_rows + 1,
            self.decode_context + start + 1,
            self.prefill_tokens,
            self.prefill_pairs,
            self.rowable,
        )

    def with_chunk(self, start: int, tokens: int, as_rows: bool = True) -> StepShape:
        return StepShape(
            self.decode_rows,
            self.decode_context,
            self.prefill_tokens + tokens,
            self.prefill_pairs + tokens * (start + tokens / 2),
            self.rowable and as_rows,
        )

    def runs_as_rows(self, limit: int) -> bool:
        """Whether the step's chunks are fed as decode rows where the device's fused decode
        takes prompts of steps of up to `limit` rows (ForwardHooks.fused_prompt_rows; the
        runner asks this of each step, the cost model of each shape it prices)."""
        return (
            self.prefill_tokens > 0
            and self.rowable
            and self.decode_rows + self.prefill_tokens <= limit
        )

    def as_run(self, limit: int) -> StepShape:
        """The step as the device runs it: with its chunks as decode rows where runs_as_rows.
        A chunk of t tokens after s attends over t * s + t * (t + 1) / 2 tokens as rows, its
        pairs plus t / 2."""
        if not self.runs_as_rows(limit):
            return self
        return StepShape(
            decode_rows=self.decode_rows + self.prefill_tokens,
            decode_context=self.decode_context
            + round(self.prefill_pairs + self.prefill_tokens / 2),
        )

    def features(self) -> tuple[float, ...]:
        raw = (
            1.0,
            self.decode_rows,
            self.decode_context,
            self.prefill_tokens,
            self.prefill_pairs,
            1.0 if self.prefill_tokens else 0.0,
        )
        return tuple(x * s for x, s in zip(raw, SCALES, strict=True))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_nonnegative(rows: list[tuple[tuple[float, ...], float]]) -> list[float] | None:
    """Least squares over (features, seconds) rows with every coefficient >= 0."""
    if not rows:
        return None
    sums = NormalSums(len(rows[0][0]))
    for x, y in rows:
        sums.add(x, y, 1.0)
    return sums.fit()


class NormalSums:
    """The normal equations' sums (X'X, X'y) of weighted rows."""

    def __init__(self, width: int) -> None:
        self.xtx = [[0.0] * width for _ in range(width)]
        self.xty = [0.0] * width
        self.count = 0

    def add(self, x: tuple[float, ...], y: float, decay: float) -> None:
        """Add a row, the earlier ones weighted `decay` times less."""
        for i, xi in enumerate(x):
            self.xty[i] = decay * self.xty[i] + xi * y
            row = self.xtx[i]
            for j, xj in enumerate(x):
                row[j] = decay * row[j] + xi * xj
        self.count += 1

    def plus(self, other: NormalSums) -> NormalSums:
        both = NormalSums(len(self.xty))
        both.xtx = [
            [a + b for a, b in zip(r, o, strict=True)]
            for r, o in zip(self.xtx, other.xtx, strict=True)
        ]
        both.xty = [a + b for a, b in zip(self.xty, other.xty, strict=True)]
        both.count = self.count + other.count
        return both

    def fit(self) -> list[float] | None:
        """Least squares with every coefficient >= 0 (a cost never makes a step faster):
        solve, drop the columns that came out negative, solve again (an active set, a few
        rounds)."""
        width = len(self.xty)
        active = list(range(width))
        for _ in range(width):
            ata = [[self.xtx[i][j] + RIDGE * (i == j) for j in active] for i in active]
            sol = _solve(ata, [self.xty[i] for i in active])
            if sol is None:
                return None
            negative = [active[k] for k, v in enumerate(sol) if v < 0]
            if not negative:
                coef = [0.0] * width
                for k, i in enumerate(active):
                    coef[i] = sol[k]
                return coef
            active = [i for i in active if i not in negative]
            if not active:
                return [0.0] * width
        return None


class StepCostModel:
    def __init__(self, prompt_rows: int = 0) -> None:
        width = len(NAMES)
        # Steps of up to this many rows run their chunks as decode rows on this device
        # (StepShape.runs_as_rows; 0: never): each shape is priced, and each step learnt, as
        # the device runs it.
        self.prompt_rows = prompt_rows
        # Per kind (decode-only, with prefill): the decayed sums, the speed factor, and the
        # last steps for the error figure.
        self._sums = {False: NormalSums(width), True: NormalSums(width)}
        self._speed = {False: 1.0, True: 1.0}
        self._recent: dict[bool, deque[tuple[tuple[float, ...], float]]] = {
            False: deque(maxlen=ERROR_WINDOW),
            True: deque(maxlen=ERROR_WINDOW),
        }
        self._since_fit = 0
        self.coef: list[float] | None = None
        self.observations = 0

    @property
    def ready(self) -> bool:
        """Fitted from steps with prefill and steps without: only then does it bound chunks."""
        return self.coef is not None and all(s.count for s in self._sums.values())

    def seed(self, steps: list[tuple[StepShape, float]]) -> None:
        """The load-time warm-up's steps (engine/step_warmup.py): the fit's first rows. The
        speed factors stay as they are: they measure the box against a fit, and a fit of the
        seed's first one or two steps is none (a 128-token chunk after another, against a fit
        of that other alone, tripled the prefill steps' factor)."""
        for shape, seconds in steps:
            shape = shape.as_run(self.prompt_rows)
            self._add(bool(shape.prefill_tokens), shape.features(), seconds)
        self.refit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A served step."""
        shape = shape.as_run(self.prompt_rows)
        if shape.decode_rows == 0 and shape.prefill_tokens == 0:
            return
        kind = bool(shape.prefill_tokens)
        x = shape.features()
        fitted = self._dot(x) if self.coef is not None else 0.0
        if fitted > 0:
            self._speed[kind] += SPEED_RATE * (seconds / fitted - self._speed[kind])
        self._add(kind, x, seconds)
        if (
            self.coef is None
            or self._since_fit >= REFIT_EVERY
            or self._sums[kind].count <= FRESH_STEPS
        ):
            self.refit()

    def _add(self, kind: bool, x: tuple[float, ...], seconds: float) -> None:
        """A step's row in its kind's sums (`kind`: it has prefill; `x`: its features)."""
        self._sums[kind].add(x, seconds, FORGET)
        self._recent[kind].append((x, seconds))
        self.observations += 1
        self._since_fit += 1

    def refit(self) -> None:
        coef = self._sums[False].plus(self._sums[True]).fit()
        self._since_fit = 0
        if coef is None:
            return
        self.coef = coef

    def _dot(self, features: tuple[float, ...]) -> float:
        assert self.coef is not None
        return sum(c * x for c, x in zip(self.coef, features, strict=True))

    def _scaled(self, features: tuple[float, ...]) -> float:
        # features[-1]: the prefill-step indicator (StepShape.features).
        return self._dot(features) * self._speed[features[-1] > 0]

    def mean_abs_error_s(self) -> float:
        """Of the estimates over the last steps of each kind (for the stats, not the loop)."""
        rows = [*self._recent[False], *self._recent[True]]
        if self.coef is None or not rows:
            return 0.0
        return sum(abs(self._scaled(x) - y) for x, y in rows) / len(rows)

    def estimate(self, shape: StepShape) -> float | None:
        """Seconds the step is expected to take (None until fitted)."""
        if self.coef is None:
            return None
        return self._scaled(shape.as_run(self.prompt_rows).features())

    def decode_row_terms(self) -> tuple[float, float]:
        """(seconds a decode row adds, seconds per context token it attends over): what the
        speculative planner prices each draft row with, without building shapes."""
        assert self.coef is not None
        speed = self._speed[False]
        return self.coef[1] * SCALES[1] * speed, self.coef[2] * SCALES[2] * speed

    def max_chunk(
        self, shape: StepShape, start: int, remaining: int, limit_s: float, as_rows: bool = True
    ) -> int:
        """The largest chunk of a prompt at `start` (at most `remaining` tokens) that keeps a step
        of `shape` plus the chunk within `limit_s`; never below MIN_CHUNK (nor above
        `remaining`). The cost grows with the chunk (but for the drop where it no longer runs as
        decode rows), so a bisection finds one that fits. `as_rows`: the chunk's request may
        run as rows (rowable)."""
        if not self.ready:
            return remaining
        floor = min(MIN_CHUNK, remaining)

        def fits(tokens: int) -> bool:
            cost = self.estimate(shape.with_chunk(start, tokens, as_rows))
            return cost is not None and cost <= limit_s

        if fits(remaining):
            return remaining
        lo, hi = floor, remaining  # fits(hi) is False
        if not fits(lo):
            return floor
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def describe(self) -> dict[str, Any]:
        """The current figures in readable units (ms; µs per context token)."""
        coef = self.coef or [0.0] * len(NAMES)
        # As the estimates use them: the decode terms at decode steps' speed, the prefill
        # terms at prefill steps'.
        speeds = [self._speed[False]] * 3 + [self._speed[True]] * 3
        per = [c * s * v for c, s, v in zip(coef, SCALES, speeds, strict=True)]
        return {
            "fitted": self.coef is not None,
            "ready": self.ready,
            "observations": self.observations,
            "step_ms": per[0] * 1e3,
            "decode_row_ms": per[1] * 1e3,
            "decode_context_us_per_token": per[2] * 1e6,
            "prefill_token_ms": per[3] * 1e3,
            "prefill_pair_ns": per[4] * 1e9,
            "prefill_step_ms": per[5] * 1e3,
            "mean_abs_error_ms": self.mean_abs_error_s() * 1e3,
        }

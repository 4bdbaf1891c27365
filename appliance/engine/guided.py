"""Grammar-constrained decoding in the engine core, next to the sampler (xgrammar).

A constraint is compiled once per text (xgrammar's compiler caches by it); each constrained
request gets its own matcher, keyed by request id, created when it is first sampled. Each
step, one call fills the token bitmask of every constrained row in the batch (xgrammar's
batch matcher, its own threads), and the sampler applies it to the logits in one batched op;
unconstrained rows are never touched. The matcher advances with each sampled token.

Lifecycle: a matcher goes when the scheduler reports its request done (finished by EOS,
max_tokens, a stop string's abort or a client's). Preemption keeps it: a swapped request
resumes where it was, a recomputed one re-prefills tokens the matcher has already accepted
and samples the next one. Each row records how many tokens its matcher accepted; a request
sampled at an earlier output index than that (a token the scheduler dropped) is rolled back.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from appliance.engine.guided_check import choice_ebnf
from appliance.sampling_params import StructuredOutputs

log = logging.getLogger("appliance.engine.guided")
# xgrammar 0.2.9 writes length-bounded JSON strings (minLength/maxLength) as characters
# `[^"\\\r\n]`, which lets raw control characters through (invalid JSON: a strict parser
# such as pydantic's refuses "\x0b" inside a string). Its unbounded strings exclude them; the
# bounded ones are tightened to the same class before compiling.
_LOOSE_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\]"
# Compiled grammars kept, by constraint text (a schema compiles in ~10 ms, a hit in ~0).
_CACHE_SIZE = 256


def json_schema_ebnf(schema: str, strict: bool = True) -> str:
    """The grammar of a JSON schema (compact separators), control characters excluded."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(grammar).replace(_LOOSE_CHARS, _JSON_CHARS)


@dataclass
class _Row:
    matcher: xgr.GrammarMatcher
    # Tokens accepted so far (= the request's output index of the next token to sample).
    accepted: int = 0
    # The matcher refused a token (a ban such as min_tokens forced one outside the grammar):
    # the row is no longer constrained rather than masked to nothing.
    broken: bool = False


class GuidedDecoder:
    """Compiled grammars, per-request matchers and the batch bitmask, for one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.rows: dict[str, _Row] = {}
        self._compiler: xgr.GrammarCompiler | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None
        self._compiled: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        # Seconds the last compile() took, and all mask fills and token accepts (the bench).
        self.last_compile_s = 0.0
        self.fill_s = 0.0
        self.accept_s = 0.0

    # -- grammars --------------------------------------------------------------------------------
    @property
    def compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: the vocabulary scan takes ~0.2 s for 49K tokens, paid only by
        # an engine that serves a constrained request.
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            threads = max(1, min(8, os.cpu_count() or 1))
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
            self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        return self._compiler

    def compile(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        started = time.perf_counter()
        grammar = self._compiled.get(so.key)
        if grammar is None:
            grammar = self._compile(so)
            if len(self._compiled) >= _CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))  # oldest first
            self._compiled[so.key] = grammar
        self.last_compile_s = time.perf_counter() - started
        return grammar

    def _compile(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        c = self.compiler
        if so.kind == "json":
            # Compact JSON: a flexible-whitespace grammar lets a weak model emit whitespace
            # forever; strict mode (xgrammar's default, vLLM's too) forbids properties the
            # schema does not name, as OpenAI's strict schemas do.
            grammar = c.compile_grammar(json_schema_ebnf(so.spec))
        elif so.kind == "json_object":
            grammar = c.compile_grammar(json_schema_ebnf('{"type": "object"}', strict=False))
        elif so.kind == "regex":
            grammar = c.compile_regex(so.spec)
        elif so.kind == "choice":
            grammar = c.compile_grammar(choice_ebnf(so.spec))
        else:
            grammar = c.compile_grammar(so.spec)
        return grammar

    # -- per step --------------------------------------------------------------------------------
    def _row(self, request_id: str, so: StructuredOutputs, output_index: int) -> _Row:
        row = self.rows.get(request_id)
        if row is None:
            matcher = xgr.GrammarMatcher(self.compile(so))
            row = self.rows[request_id] = _Row(matcher)
        if output_index < row.accepted:
            row.matcher.rollback(row.accepted - output_index)
            row.accepted = output_index
        elif output_index > row.accepted:
            # Tokens this matcher never saw: cannot be replayed here, so stop constraining
            # rather than mask against the wrong state. The scheduler never does this.
            log.warning("%s: matcher at %d, sampling %d", request_id, row.accepted, output_index)
            row.broken = True
        return row

    def bitmask(
        self, rows: list[tuple[str, StructuredOutputs, int] | None]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """Fill the bitmask of the constrained rows (request id, constraint, output index);
        returns it with their batch indices, or None when no row is constrained."""
        indices = []
        matchers = []
        for i, spec in enumerate(rows):
            if spec is None:
                continue
            row = self._row(*spec)
            if row.broken or row.matcher.is_terminated():
                continue
            indices.append(i)
            matchers.append(row.matcher)
        if not indices:
            return None
        n = len(rows)
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
        bitmask = self._bitmask[:n]
        assert bitmask.shape[1] == words and self._batch is not None
        t0 = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        self.fill_s += time.perf_counter() - t0
        return bitmask, indices

    def valid_draft_prefix(
        self, request_id: str, so: StructuredOutputs, output_index: int, drafts: list[int]
    ) -> int:
        """How many leading `drafts` the grammar allows after the request's tokens so far; the
        matcher is left where it was (speculative drafts are checked before they are scored)."""
        row = self._row(request_id, so, output_index)
        if row.broken or row.matcher.is_terminated():
            return len(drafts)  # unconstrained from here
        n = 0
        for token in drafts:
            if not row.matcher.accept_token(token):
                break
            n += 1
        if n:
            row.matcher.rollback(n)
        return n

    def accept(self, request_id: str, token: int) -> None:
        t0 = time.perf_counter()
        try:
            self._accept(request_id, token)
        finally:
            self.accept_s += time.perf_counter() - t0

    def _accept(self, request_id: str, token: int) -> None:
        row = self.rows.get(request_id)
        if row is None or row.broken:
            return
        if row.matcher.is_terminated():
            row.accepted += 1  # past the end (ignore_eos): nothing more to check
            return
        if not row.matcher.accept_token(token):
            log.warning(
                "%s: token %d is outside the grammar; unconstrained from here", request_id, token
            )
            row.broken = True
        row.accepted += 1

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Disallowed tokens of the constrained rows to -inf, in place, in one call (xgrammar's
    CPU kernel on CPU logits, its CUDA/Triton one on the GPU)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)

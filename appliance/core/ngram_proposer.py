"""Prompt-lookup drafting (vLLM's "ngram" method): find where a request's last few tokens
occurred before in its own prompt and output, and propose the tokens that followed there.

Pure Python over token ids. Each request keeps an index of its n-grams of the shortest lookup
length (`NgramIndex`, on the request record), extended as tokens arrive, so a lookup costs a
dict probe and a short backward comparison instead of a scan over a long prompt each step."""

from __future__ import annotations

from dataclasses import dataclass, field

# Occurrences remembered per n-gram: the most recent ones, where a summary's copy usually is.
MAX_OCCURRENCES = 8


@dataclass
class NgramIndex:
    """Start positions of every `n`-gram of a token list that has a token after it."""

    n: int
    positions: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    # N-grams starting at 0 .. indexed - 1 are in `positions`.
    indexed: int = 0

    def extend(self, tokens: list[int]) -> None:
        n = self.n
        # An n-gram at i counts once a token follows it (i + n < len(tokens)).
        while self.indexed + n < len(tokens):
            i = self.indexed
            starts = self.positions.setdefault(tuple(tokens[i : i + n]), [])
            starts.append(i)
            if len(starts) > MAX_OCCURRENCES:
                del starts[0]
            self.indexed += 1


def propose(tokens: list[int], index: NgramIndex, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` drafts: the tokens after the earlier occurrence of the longest suffix
    of `tokens` (between index.n and max_n tokens long) that occurred before; the most recent
    occurrence among equally long matches. Empty when the last index.n tokens never occurred."""
    n = index.n
    length = len(tokens)
    if num_tokens <= 0 or length <= n:
        return []
    index.extend(tokens)
    starts = index.positions.get(tuple(tokens[length - n :]))
    if not starts:
        return []
    best_len, best_start = 0, -1
    for start in reversed(starts):
        # Extend the match backwards from the n-gram, up to max_n tokens in all.
        matched = n
        while (
            matched < max_n
            and start - (matched - n) - 1 >= 0
            and tokens[start - (matched - n) - 1] == tokens[length - matched - 1]
        ):
            matched += 1
        if matched > best_len:
            best_len, best_start = matched, start
            if matched == max_n:
                break
    follow = best_start + n
    return tokens[follow : follow + num_tokens]

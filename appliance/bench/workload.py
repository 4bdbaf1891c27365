"""Request mixes for the serving benchmark: token-id prompts of set lengths, output lengths,
priority classes and arrival times, all from one seed, so that a served run and an offline run
see exactly the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Item:
    index: int
    # Seconds after the start of the run.
    arrival_s: float
    prompt: list[int]
    output_len: int
    priority_class: str
    # The same prompt as words, for servers that take no token ids (--prompt-format text).
    text: str = ""
    # The profile's kind of request it was drawn from (short, long, ...): SLOs and plots use it.
    kind: str = ""


@dataclass(frozen=True)
class Kind:
    # short, medium or long: `bench serve` reports goodput per kind and takes SLOs per kind.
    name: str
    share: float
    priority_class: str
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


# Issue 3's mix: 80% short real-time chat, 20% long batch summarisation.
PROFILES: dict[str, list[Kind]] = {
    "chat": [Kind("short", 1.0, "realtime", (32, 96), (32, 128))],
    "long": [Kind("long", 1.0, "batch", (1400, 1500), (384, 512))],
    "mixed": [
        Kind("short", 0.8, "realtime", (48, 80), (64, 128)),
        Kind("long", 0.2, "batch", (1400, 1500), (384, 512)),
    ],
    "batch": [Kind("medium", 1.0, "batch", (192, 320), (192, 320))],
}

_WORDS = (
    "the appliance serves tokens from a paged cache while batches of requests arrive "
    "and leave at every step of the engine"
).split()


def make_workload(
    profile: str,
    n: int,
    arrival: str,
    rate: float,
    seed: int,
    vocab: int = 8000,
    prompt_len: int = 0,
    output_len: int = 0,
) -> list[Item]:
    """`prompt_len` / `output_len` (0: the profile's ranges) fix every request's lengths."""
    rng = random.Random(seed)
    kinds = [
        Kind(
            k.name,
            k.share,
            k.priority_class,
            (prompt_len, prompt_len) if prompt_len else k.prompt_len,
            (output_len, output_len) if output_len else k.output_len,
        )
        for k in PROFILES[profile]
    ]
    weights = [k.share for k in kinds]
    t = 0.0
    items = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        plen = rng.randint(*kind.prompt_len)
        prompt = [rng.randrange(16, vocab) for _ in range(plen)]
        text = " ".join(rng.choice(_WORDS) for _ in range(plen))
        out_len = rng.randint(*kind.output_len)
        items.append(Item(i, t, prompt, out_len, kind.priority_class, text, kind.name))
        if arrival == "poisson":
            t += rng.expovariate(rate)
    return items

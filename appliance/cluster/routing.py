"""Which replica a request goes to (pure: no Ray, no I/O, tested in milliseconds).

The ingress sees each replica's load as the replica last reported it (its engine's waiting
requests) plus the requests this ingress has in flight there (exact and immediate, so a burst
between two reports spreads). "queue" orders replicas by that load; "prefix" puts first the
replica a rendezvous hash of the prompt's opening characters picks, so requests sharing a
system prompt meet the same prefix cache, unless that replica is more than `imbalance`
requests busier than the least loaded one (then load wins). The order is also the retry
order: a 429, a 503 (draining, reloading) or a dead replica moves the request to the next."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from appliance.stats import ReplicaLoad


def affinity_key(body: Any, prefix_chars: int) -> str | None:
    """The opening characters of a request's prompt (a chat's messages in order, roles
    included): requests that share them share their first KV blocks."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("messages"), list):
        parts: list[str] = []
        for msg in body["messages"]:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{msg.get('role')}:{content if isinstance(content, str) else ''}\n")
            if sum(len(p) for p in parts) >= prefix_chars:
                break
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else str(prompt)[: prefix_chars * 4]
    return text[:prefix_chars] if text else None


def _rendezvous(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replica_order(
    replicas: list[ReplicaLoad],
    inflight: dict[str, int],
    policy: str,
    key: str | None,
    imbalance: int,
    rng: random.Random | None = None,
) -> list[ReplicaLoad]:
    """The ready replicas in the order to try them."""
    ready = [r for r in replicas if r.phase == "ready"]
    if not ready:
        return []
    pick = rng or random

    def load(r: ReplicaLoad) -> int:
        return r.num_waiting + inflight.get(r.replica_id, 0)

    # Random tie-break: equal loads must not all land on the first replica listed.
    shuffled = pick.sample(ready, len(ready))
    by_load = sorted(shuffled, key=load)
    if policy != "prefix" or key is None:
        return by_load
    home = max(ready, key=lambda r: _rendezvous(key, r.replica_id))
    if load(home) > load(by_load[0]) + imbalance:
        return by_load
    return [home] + [r for r in by_load if r is not home]

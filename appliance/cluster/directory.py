"""The directory: each replica's latest load report, read by the ingress (routing) and by
`appliance cluster status`. A Ray Serve deployment of one replica (app.py wraps it), so the
application owns it and `cluster down` removes it with the rest."""

from __future__ import annotations

import time

from appliance.cluster.routing import ReplicaLoad

# A replica that has not reported for this long is gone (killed, or its node lost): the ingress
# stops routing to it before Ray Serve's health check notices.
STALE_AFTER_S = 3.0


class Directory:
    def __init__(self) -> None:
        self._loads: dict[str, ReplicaLoad] = {}

    def report(self, load: ReplicaLoad) -> None:
        load.reported_at = time.time()
        self._loads[load.replica_id] = load

    def leave(self, replica_id: str) -> None:
        self._loads.pop(replica_id, None)

    def snapshot(self) -> list[ReplicaLoad]:
        now = time.time()
        for rid in [r for r, load in self._loads.items() if now - load.reported_at > STALE_AFTER_S]:
            del self._loads[rid]
        return sorted(self._loads.values(), key=lambda r: (r.pool, r.replica_id))

"""The cluster's /metrics: every replica's own series (vLLM's names, as each appliance server
exports them) with a `replica` label added, so the shipped Grafana dashboard shows each replica
and, summed by model_name, the cluster; plus the ingress's own `appliance_cluster_*` series."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry


class MergedReplicas(Collector):
    """A collector over texts scraped just now: {replica id: exposition text}."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for s in family.samples:
                    merged.add_sample(
                        s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar
                    )
        yield from families.values()


def render(texts: dict[str, str], own: Iterable[CollectorRegistry]) -> bytes:
    from prometheus_client import generate_latest

    registry = CollectorRegistry()
    registry.register(MergedReplicas(texts))
    out = generate_latest(registry)
    for reg in own:
        out += generate_latest(reg)
    return out

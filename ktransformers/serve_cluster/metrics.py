"""The router's ``GET /metrics``: every replica's series, each under a ``replica`` label.

One scrape target for the whole deployment; the replicas' texts are parsed and re-rendered by
prometheus_client, so types, help and histogram buckets stay as each replica wrote them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

LABEL = "replica"


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text of ``{replica name: its /metrics text}`` with ``replica="name"`` on every
    sample; a family several replicas report is one family."""
    merged: dict[str, object] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            target = merged.setdefault(fam.name, fam)
            samples = [Sample(s.name, {**s.labels, LABEL: replica}, s.value, s.timestamp, s.exemplar)
                       for s in fam.samples]
            if target is fam:
                fam.samples = samples
            else:
                target.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)

"""Read an engine's ``/metrics`` the way Prometheus does: with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> list[Sample]:
    """Every sample of an exposition (the parser raises on anything malformed)."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample ``name`` whose labels include ``labels``."""
    found = [
        s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items()
    ]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} samples of {name}{labels or ''} in /metrics")
    return float(found[0])

"""The engine's ``/metrics``, through prometheus_client, in SGLang's naming.

Dashboards and alerts written for an SGLang fleet should work unchanged on TIDE's
reference engine, and TIDE's own series (capture, swaps, the k controller) sit
beside them under ``tide:``. Counts the engine already keeps (its counters, the
lake writer's stats, the k controller's choice) are read at scrape time by a
collector, so there is one source of truth; per-request distributions
(acceptance length per draft version, capture latency, end-to-end latency) are
histograms observed as requests finish. Each engine has its own registry, so
several engines in one process (tests, benchmarks) never mix their series.
"""

from __future__ import annotations

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tide_lib.serving.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ACCEPT_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
_VERSIONS_KEPT = 3  # the version served, and two before it (a rollback's target)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """One engine's registry: scrape-time figures plus three histograms."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        model = ["model_name"]
        self.accept_length = Histogram(
            "tide:spec_accept_length_per_request",
            "Acceptance length of each speculative request, by the draft version serving it",
            [*model, "weight_version"],
            buckets=_ACCEPT_BUCKETS,
            registry=self.registry,
        )
        self.capture_latency = Histogram(
            "tide:capture_latency_seconds",
            "Time to build a request's lake record and hand it to the writer",
            model,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency",
            model,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        self._versions: list[str] = []  # label values of accept_length, oldest first

    def observe_accept_length(self, model: str, version: str, value: float) -> None:
        """One request's acceptance length; series of versions no longer served are
        dropped once two newer ones have been seen (bounded, whoever names versions)."""
        if version not in self._versions:
            self._versions.append(version)
            while len(self._versions) > _VERSIONS_KEPT:
                self.accept_length.remove(model, self._versions.pop(0))
        self.accept_length.labels(model, version).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Counters and gauges the engine keeps anyway, read when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        model = engine.target_id
        counters = engine.counters
        stats = engine.writer.stats() if engine.writer is not None else None
        counts: list[tuple[str, str, float]] = [
            ("sglang:prompt_tokens", "Prefill tokens processed", counters.prompt_tokens),
            ("sglang:generation_tokens", "Generation tokens", counters.generation_tokens),
            ("sglang:num_requests", "Requests finished", counters.requests),
            ("tide:capture_records", "Requests captured into the lake", counters.captured),
            ("tide:capture_skipped", "Requests capture skipped", counters.capture_skipped),
            (
                "tide:capture_dropped_records",
                "Captured requests the writer dropped (queue, spool or refusal)",
                stats.dropped_records if stats else 0,
            ),
            ("tide:draft_swaps", "Draft swaps applied", counters.swaps),
        ]
        for name, help_text, value in counts:
            yield _one(CounterMetricFamily, name, help_text, model, value)
        gauges: list[tuple[str, str, float]] = [
            ("sglang:num_running_reqs", "Requests being decoded", engine.running()),
            ("sglang:num_queue_reqs", "Requests waiting for a decode slot", engine.queue_depth()),
            (
                "sglang:spec_accept_length",
                "Average acceptance length since the last draft swap",
                engine.avg_accept_length(),
            ),
            ("tide:speculative_enabled", "1 if a draft is loaded", int(engine.speculative)),
            (
                "tide:capture_spooled_shards",
                "Lake shards waiting on local disk for the object store",
                stats.spooled_shards if stats else 0,
            ),
        ]
        for name, help_text, value in gauges:
            yield _one(GaugeMetricFamily, name, help_text, model, value)
        yield from _speculation(engine.k_controller.snapshot(), model)


def _one(family: Callable[..., Any], name: str, help_text: str, model: str, value: float) -> Any:
    metric = family(name, help_text, labels=["model_name"])
    metric.add_metric([model], value)
    return metric


def _speculation(choice: dict[str, Any], model: str) -> Iterator[Metric]:
    """The k the engine serves with (SGLang's ``sglang:spec_num_steps``) and why: per k,
    expected tokens/s, verify cost and what it delivered against plain decoding; per
    segment label, its chosen k. Figures not
    measured yet are left out."""
    costs = choice["costs"]
    series: list[tuple[Callable[..., Any], str, str, str | None, dict[Any, Any]]] = [
        (GaugeMetricFamily, "sglang:spec_num_steps", "Draft tokens per verify step (k)", None,
         {"": choice["chosen_k"]}),
        (GaugeMetricFamily, "tide:spec_adaptive", "1 if k follows measured costs", None,
         {"": int(choice["adaptive"])}),
        (GaugeMetricFamily, "tide:spec_draft_step_seconds", "Measured cost of one draft step",
         None, {"": costs["draft_step_s"]}),
        (GaugeMetricFamily, "tide:spec_verify_seconds", "Modelled cost of a verify step at k", "k",
         costs["verify_s"] or {}),
        (GaugeMetricFamily, "tide:spec_expected_tokens_per_s", "Expected tokens/s at each k",
         "k", choice["expected_tokens_per_s"] or {}),
        (GaugeMetricFamily, "tide:spec_realized_vs_plain",
         "Tokens/s each k delivered over plain decoding's, measured side by side", "k",
         choice["realized_vs_plain"]),
        (GaugeMetricFamily, "tide:spec_model_error",
         "Tokens/s the served k's delivered over what the cost model expected of them", None,
         {"": choice["model_error"]}),
        (CounterMetricFamily, "tide:spec_requests", "Requests served at each k", "k",
         choice["requests_by_k"]),
        (GaugeMetricFamily, "tide:spec_segment_num_steps", "k chosen for each segment label",
         "segment", {name: s["chosen_k"] for name, s in choice["segments"].items()}),
    ]  # fmt: skip
    for family, name, help_text, label, values in series:
        metric = family(name, help_text, labels=["model_name", *([label] if label else [])])
        for key, value in values.items():
            if value is not None:
                metric.add_metric([model, *([str(key)] if label else [])], value)
        yield metric

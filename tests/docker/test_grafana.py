"""The Grafana dashboard in docker/grafana plots only series TIDE really exports.

The engine's registry (:class:`tide_lib.serving.metrics.EngineMetrics`) is built over a
stand-in engine state and rendered; the SGLang plugin's counters come from its own
table. A panel naming a series neither exports would stay empty in production.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from tests.prometheus import samples
from tide_lib.serving import sglang_plugin
from tide_lib.serving.engine import EngineCounters
from tide_lib.serving.k_policy import KController
from tide_lib.serving.metrics import EngineMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "tide-dashboard.json"
_SERIES = re.compile(r"\b((?:sglang|tide):[a-z_]+)")


def _engine_series() -> set[str]:
    engine = SimpleNamespace(
        target_id="demo",
        counters=EngineCounters(),
        writer=None,
        speculative=True,
        k_controller=KController(3, adaptive=True),
        running=lambda: 0,
        queue_depth=lambda: 0,
        avg_accept_length=lambda: 2.5,
    )
    metrics = EngineMetrics(engine)  # type: ignore[arg-type]  # the attributes it reads
    metrics.observe_accept_length("demo", "4", 2.5)
    metrics.capture_latency.labels("demo").observe(0.01)
    metrics.e2e_latency.labels("demo").observe(0.2)
    return {sample.name for sample in samples(metrics.render().decode())}


def test_every_series_on_the_dashboard_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in _SERIES.findall(expr)}
    plugin = {f"tide:capture_{kind}_total" for kind in sglang_plugin._METRIC_HELP}
    exported = _engine_series() | plugin
    assert used, "the dashboard plots nothing"
    assert used <= exported, f"not exported by the engine or the plugin: {used - exported}"
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Acceptance length per draft version", "Capture rate"} <= titles
    assert any("weight_version" in expr for expr in exprs)
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"${datasource}"}


def test_acceptance_series_of_old_versions_are_dropped() -> None:
    """Versions are named by whoever swaps drafts: the series stay bounded."""
    engine = SimpleNamespace(target_id="demo", counters=EngineCounters(), writer=None)
    metrics = EngineMetrics(engine)  # type: ignore[arg-type]
    for version in ["1", "2", "3", "4", "4", "5"]:
        metrics.observe_accept_length("demo", version, 2.0)
    counts = [
        s
        for family in metrics.accept_length.collect()
        for s in family.samples
        if s.name == "tide:spec_accept_length_per_request_count"
    ]
    assert {s.labels["weight_version"]: s.value for s in counts} == {"3": 1, "4": 2, "5": 1}

"""TIDE's view inside the Airflow UI: per target, what serves, what each cycle decided.

A small FastAPI app that Airflow's API server mounts at ``/tide`` (see
``plugins/tide_plugin.py``). Everything it shows comes from MLflow: the versions
behind the ``champion``, ``challenger`` and ``previous-champion`` aliases, the
recent cycles with their gate decisions, the acceptance length per traffic segment
that each draft's evaluation logged as MLflow metrics (the figures the MLflow UI
charts), and a plot of acceptance length over versions, each version linked to its
page in MLflow.
"""

from __future__ import annotations

__all__ = ["create_app", "dashboard_data", "render_dashboard"]

import base64
import html
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from tide_lib.config import TideConfig, load_config
from tide_lib.names import Tags

logger = logging.getLogger(__name__)

_ALIASES = ("champion", "challenger", "previous-champion")
_MAX_CYCLES = 20


def dashboard_data(config: TideConfig, target_id: str) -> dict[str, Any]:
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415
    from tide_lib.registry import DraftRegistry  # noqa: PLC0415

    registry = DraftRegistry(config.mlflow.tracking_uri, target_id)
    cycles: list[dict[str, Any]] = []
    for version in registry.versions(last=_MAX_CYCLES):
        decision = decision_from_tags(version.tags, config.gate.k)
        cycles.append(
            {
                "version": version.version,
                "aliases": version.aliases,
                "cycle_id": version.tags.get(Tags.CYCLE_ID, ""),
                "decision": version.tags.get(Tags.DECISION, "pending"),
                "reason": decision.reason if decision else "",
                "window_tokens": version.tags.get(Tags.WINDOW_TOKENS, ""),
                "accept_length": _accept_lengths(registry, version, decision, config.gate.k),
                "created": version.created_ms,
            }
        )
    aliases = {
        alias: next((c["version"] for c in cycles if alias in c["aliases"]), None)
        for alias in _ALIASES
    }
    return {
        "target_id": target_id,
        "model_name": registry.name,
        "mlflow_url": config.mlflow.tracking_uri.rstrip("/"),
        "aliases": aliases,
        "cycles": cycles,
        "k": config.gate.k,
    }


def _accept_lengths(registry: Any, version: Any, decision: Any, k: int) -> dict[str, float]:
    """The version's logged acceptance-length metrics; where they cannot be read (or a
    judged version has none), the figures its decision tags recorded."""
    from tide_lib.evaluation.tracking import logged_accept_lengths  # noqa: PLC0415

    try:
        logged = logged_accept_lengths(registry, version, k)
    except Exception as error:  # one version's metrics never take the page down
        logger.warning("metrics of %s v%s unreadable: %s", registry.name, version.version, error)
        logged = {}
    return logged or (dict(decision.challenger) if decision else {})


def _plot(data: dict[str, Any]) -> str:
    from tide_lib.evaluation.plot import plot_acceptance  # noqa: PLC0415

    history = {f"v{c['version']}": c["accept_length"] for c in data["cycles"] if c["accept_length"]}
    if not history:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_acceptance(history, Path(tmp) / "al.png", k=data["k"], title=data["model_name"])
        return base64.b64encode(path.read_bytes()).decode()


def _accept_text(accept: dict[str, float]) -> str:
    return " · ".join(f"{segment} {value:.2f}" for segment, value in sorted(accept.items()))


def render_dashboard(data: dict[str, Any]) -> str:
    def link(version: str | None) -> str:
        if version is None:
            return "<em>none yet</em>"
        url = f"{data['mlflow_url']}/#/models/{data['model_name']}/versions/{version}"
        return f'<a href="{html.escape(url)}" target="_blank">v{html.escape(version)}</a>'

    alias_rows = "".join(
        f"<tr><th>{alias}</th><td>{link(version)}</td></tr>"
        for alias, version in data["aliases"].items()
    )
    cycle_rows = "".join(
        "<tr>"
        f"<td>{link(c['version'])}</td>"
        f"<td>{html.escape(', '.join(c['aliases']))}</td>"
        f"<td class='{html.escape(c['decision'])}'>{html.escape(c['decision'])}</td>"
        f"<td>{html.escape(_accept_text(c['accept_length']))}</td>"
        f"<td>{html.escape(c['window_tokens'])}</td>"
        f"<td class='reason'>{html.escape(c['reason'])}</td>"
        "</tr>"
        for c in reversed(data["cycles"])
    )
    model_url = f"{data['mlflow_url']}/#/models/{data['model_name']}"
    plot = _plot(data)
    image = (
        f'<img alt="acceptance length per version" src="data:image/png;base64,{plot}">'
        if plot
        else ""
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>TIDE · {html.escape(data["target_id"])}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #1f2933; }}
table {{ border-collapse: collapse; margin-bottom: 20px; }}
th, td {{ border-bottom: 1px solid #d9e2ec; padding: 6px 12px; text-align: left; }}
td.promote {{ color: #0b7a3e; font-weight: 600; }} td.reject {{ color: #b42318; font-weight: 600; }}
td.reason {{ font-size: 0.85em; color: #52606d; max-width: 520px; }}
img {{ max-width: 720px; border: 1px solid #d9e2ec; }}
</style></head><body>
<h1>TIDE — {html.escape(data["target_id"])}</h1>
<p>Registered model <a href="{html.escape(model_url)}"
target="_blank">{html.escape(data["model_name"])}</a> in MLflow.</p>
<h2>Serving</h2><table>{alias_rows}</table>
<h2>Acceptance length over versions (k={data["k"]})</h2>{image or "<p>No evaluated cycle yet.</p>"}
<h2>Recent cycles</h2>
<table><tr><th>version</th><th>aliases</th><th>gate</th><th>acceptance length</th>
<th>window tokens</th><th>reason</th></tr>{cycle_rows}</table>
</body></html>"""


def create_app(dependencies: Sequence[Any] = ()) -> FastAPI:
    """The view; ``dependencies`` guard every route (the Airflow plugin passes Airflow's
    own login check, so the view is exactly as protected as the Airflow UI)."""
    app = FastAPI(title="TIDE", description=__doc__, dependencies=list(dependencies))

    @app.get("/", response_class=HTMLResponse)
    def dashboard(target: str | None = Query(None, description="target id")) -> str:
        config = load_config()
        return render_dashboard(dashboard_data(config, target or config.cycle.target_id))

    return app

"""Gate decisions and acceptance plots, written where MLflow users look for them.

A decision is version tags (what a retried task and the drift baseline read back), a
report on the version's run, and metrics on that run and its logged model
(``eval.accept_length.*``, step = version) so the MLflow UI charts acceptance length
across versions; the Airflow view reads those metrics (:func:`logged_accept_lengths`).
"""

from __future__ import annotations

__all__ = ["log_acceptance_plot", "log_decision", "logged_accept_lengths"]

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tide_lib.evaluation.gate import (
    GateDecision,
    accept_lengths_from_metrics,
    decision_metrics,
    decision_report,
    decision_tags,
)
from tide_lib.evaluation.plot import plot_acceptance
from tide_lib.names import Tags

if TYPE_CHECKING:
    from tide_lib.registry import DraftRegistry, DraftVersion

logger = logging.getLogger(__name__)


def log_decision(registry: DraftRegistry, version: str, decision: GateDecision, k: int) -> str:
    """Record the gate's decision on a registered version: the report and the figures
    on its run (and logged model), then the version tags. Returns the report."""
    registered = registry.get(version)
    report = decision_report(decision, k, names={"challenger": f"{registry.name} v{version}"})
    # figures first: the tags end with the one that marks the record complete
    registry.log_version_text(registered, report, f"gate/decision-v{version}.md")
    registry.log_version_metrics(registered, decision_metrics(decision, k))
    tags = {key: value[:5000] for key, value in decision_tags(decision, k).items()}
    # a judging that died midway (no decision tag) may have left figures this one has
    # not, of other segments or a floor since turned off: they would be read back with it
    registry.delete_tags(
        version, [key for key in registered.tags if Tags.of_decision(key) and key not in tags]
    )
    registry.set_tags(version, tags)
    logger.info("gate on %s v%s: %s", registry.name, version, decision.reason)
    return report


def logged_accept_lengths(
    registry: DraftRegistry, version: DraftVersion, k: int
) -> dict[str, float]:
    """Acceptance length per segment at ``k`` that :func:`log_decision` logged for a
    registered ``version`` (metrics of its logged model); empty if it was never judged."""
    return accept_lengths_from_metrics(registry.logged_metrics(version), k)


def log_acceptance_plot(
    tracking_uri: str, run_id: str, history: dict[str, dict[str, float]], k: int, title: str = ""
) -> None:
    """PNG of acceptance length per draft version and segment, as an artifact of ``run_id``."""
    from mlflow import MlflowClient  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = plot_acceptance(history, Path(tmp) / f"acceptance_length_k{k}.png", k=k, title=title)
        MlflowClient(tracking_uri).log_artifact(run_id, str(path), "evaluation")

"""Training metrics to an MLflow run (the run the registry later links a draft version to)."""

from __future__ import annotations

__all__ = ["MlflowMetricSink"]

import logging
import time

logger = logging.getLogger(__name__)


class MlflowMetricSink:
    """Logs each metric dict as one ``log_batch`` call; a failed call is logged, not fatal."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        from mlflow import MlflowClient  # noqa: PLC0415

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception:  # training must not die because the tracking server blinked
            logger.exception("could not log step %d metrics to MLflow run %s", step, self.run_id)

"""tide_lake_retention: delete consumed captured shards older than the retention period.

Shards that a cycle has not consumed yet (committed after the watermark) are never
deleted, however old. Wiring only.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import dag, get_current_context, task

from tide_lib.orchestration.params import cycle_params


@dag(
    dag_id="tide_lake_retention",
    description="Apply the lake's retention period to consumed shards",
    schedule=timedelta(days=1),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params={"target_id": cycle_params()["target_id"]},
    tags=["tide", "lake"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5)},
    doc_md=__doc__,
)
def tide_lake_retention() -> None:
    @task
    def apply() -> dict[str, int]:
        from tide_lib.orchestration.cycle import apply_retention
        from tide_lib.orchestration.params import config_from_params

        return apply_retention(config_from_params(dict(get_current_context()["params"])))

    apply()


tide_lake_retention()

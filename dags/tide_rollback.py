"""tide_rollback: serve an earlier draft on the fleet and move the aliases.

Trigger it from the UI; the form asks for the target and the version (a number,
or an alias: previous-champion by default). Wiring only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

from tide_lib.orchestration.assets import champion_asset
from tide_lib.orchestration.params import cycle_params


@dag(
    dag_id="tide_rollback",
    description="Roll the serving draft back to an earlier registered version",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params={
        "target_id": cycle_params()["target_id"],
        "version": Param(
            "previous-champion",
            type="string",
            description="registered version number, or an alias (previous-champion, champion)",
        ),
    },
    tags=["tide", "speculative-decoding"],
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30)},
    doc_md=__doc__,
)
def tide_rollback() -> None:
    @task(outlets=[champion_asset()])  # a rollback changes the champion too
    def roll_back() -> dict[str, Any]:
        from tide_lib.orchestration.assets import emit
        from tide_lib.orchestration.cycle import rollback
        from tide_lib.orchestration.params import config_from_params

        context = get_current_context()
        params = dict(context["params"])
        # the run id: a retry of this run rolls back to what its first attempt chose
        config = config_from_params(params)
        done = rollback(config, str(params["version"]), context["run_id"])
        emit(context, config.cycle.target_id, {"version": done["version"], "rollback": True})
        return done

    roll_back()


tide_rollback()

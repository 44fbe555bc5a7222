# mypy: disable-error-code="arg-type"
# (TaskFlow calls return XComArgs at parse time; the tasks receive the values.)
"""tide_adaptation: wait for new captured traffic, train a draft, register, gate, promote.

Training runs only when it pays: ``check_drift`` measures the champion on the new
window and skips the rest of the cycle (the watermark still moves) when it still
fits the traffic; ``challenger_improved`` stops a cycle whose best checkpoint was
its parent, so nothing is registered. Skipped tasks show pink in the grid, with
the reason in the task's log.

Wiring only: every task calls one function of tide_lib.orchestration.cycle.
Tasks run on different hosts (train on the mi250 queue); what they pass each
other through XCom are the typed hand-offs of tide_lib.orchestration.handoff:
lake keys, MLflow ids and URIs, never a local path.
Trigger it from the UI with the form (params are tide_lib.config.CycleConfig's
schema; an empty field is the deployment's setting when the run starts), or let
the schedule start a cycle that waits for new data; a window that stays quiet
for six hours skips the run rather than failing it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag, get_current_context, task

from tide_lib.orchestration.assets import champion_asset, draft_asset, lake_asset
from tide_lib.orchestration.params import adaptation_schedule, cycle_params
from tide_lib.orchestration.sensors import LakeTokensSensor


def _config() -> Any:
    from tide_lib.orchestration.params import config_from_params

    return config_from_params(dict(get_current_context()["params"]))


@dag(
    dag_id="tide_adaptation",
    description="Adapt the EAGLE3 draft to the traffic captured since the last cycle",
    schedule=adaptation_schedule(),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=cycle_params(),
    tags=["tide", "speculative-decoding"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    doc_md=__doc__,
)
def tide_adaptation() -> None:
    # A quiet window skips the run (soft fail): nothing to train is not an error.
    wait = LakeTokensSensor(
        task_id="wait_for_new_tokens",
        poke_interval=30,
        timeout=6 * 3600,
        mode="reschedule",
        soft_fail=True,
    )

    @task(outlets=[lake_asset()])
    def snapshot() -> dict[str, Any]:
        from tide_lib.orchestration.assets import emit
        from tide_lib.orchestration.cycle import snapshot_window

        context = get_current_context()
        window = snapshot_window(_config(), context["run_id"])
        emit(context, window.target_id, window.asset_extra())
        return window.to_xcom()

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def check_drift(window: dict[str, Any]) -> bool:
        from tide_lib.orchestration.cycle import check_drift as check
        from tide_lib.orchestration.handoff import Snapshot

        return check(_config(), Snapshot.from_xcom(window)).drift

    @task(
        queue="mi250",
        pool="mi250",
        retries=1,
        execution_timeout=timedelta(hours=6),
        inlets=[lake_asset(), champion_asset()],  # the window, warm-started from the champion
    )
    def train(window: dict[str, Any]) -> dict[str, Any]:
        from tide_lib.orchestration.cycle import train as train_cycle
        from tide_lib.orchestration.handoff import Snapshot

        return train_cycle(_config(), Snapshot.from_xcom(window)).to_xcom()

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def challenger_improved(trained: dict[str, Any]) -> bool:
        from tide_lib.orchestration.handoff import Trained

        return Trained.from_xcom(trained).improved

    @task(outlets=[draft_asset()])
    def register(window: dict[str, Any], trained: dict[str, Any]) -> str:
        from tide_lib.orchestration.assets import emit
        from tide_lib.orchestration.cycle import register as register_cycle
        from tide_lib.orchestration.handoff import Snapshot, Trained

        snap, run = Snapshot.from_xcom(window), Trained.from_xcom(trained)
        version = register_cycle(_config(), snap, run)
        extra = {"version": version, "run_id": run.run_id, "cycle_id": snap.cycle_id}
        emit(get_current_context(), snap.target_id, extra)
        return version

    @task
    def evaluate(window: dict[str, Any], trained: dict[str, Any], version: str) -> dict[str, Any]:
        from tide_lib.orchestration.cycle import evaluate_and_gate
        from tide_lib.orchestration.handoff import Snapshot, Trained

        config, snap = _config(), Snapshot.from_xcom(window)
        return evaluate_and_gate(config, snap, Trained.from_xcom(trained), version).to_xcom()

    # A new champion is an event on its asset; a rejected challenger skips the task
    # (no event: DAGs scheduled on the champion run only when it changed).
    @task(retries=0, outlets=[champion_asset()])
    def promote(version: str, decision: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from tide_lib.orchestration.assets import emit
        from tide_lib.orchestration.cycle import promote as promote_cycle
        from tide_lib.orchestration.handoff import Decision

        config, judged = _config(), Decision.from_xcom(decision)
        promotion = promote_cycle(config, version, judged)
        if not promotion.promoted:
            raise AirflowSkipException(f"v{version} not promoted: {promotion.reason}")
        extra = {"version": version, "accept_length": judged.challenger}
        emit(get_current_context(), config.cycle.target_id, extra)
        return promotion.to_xcom()

    # Also after a skipped (no drift, no gain) cycle; not after a quiet window (no snapshot).
    @task(trigger_rule="none_failed_min_one_success")
    def advance_watermark(window: dict[str, Any], _promotion: dict[str, Any] | None) -> str:
        from tide_lib.orchestration.cycle import advance_watermark as advance
        from tide_lib.orchestration.handoff import Snapshot

        return advance(_config(), Snapshot.from_xcom(window))

    window = snapshot()
    wait >> window
    trained = train(window)
    check_drift(window) >> trained
    improved = challenger_improved(trained)
    version = register(window, trained)
    improved >> version
    decision = evaluate(window, trained, version)
    advance_watermark(window, promote(version, decision))


tide_adaptation()

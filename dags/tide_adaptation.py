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
Trigger it from the UI with the form (params mirror tide_lib.config.CycleConfig),
or let the schedule start a cycle that waits for new data.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import dag, get_current_context, task

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
    wait = LakeTokensSensor(
        task_id="wait_for_new_tokens", poke_interval=30, timeout=6 * 3600, mode="reschedule"
    )

    @task
    def snapshot() -> dict[str, Any]:
        from tide_lib.orchestration.cycle import snapshot_window

        return snapshot_window(_config(), get_current_context()["run_id"]).to_xcom()

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def check_drift(window: dict[str, Any]) -> bool:
        from tide_lib.orchestration.cycle import check_drift as check
        from tide_lib.orchestration.handoff import Snapshot

        return check(_config(), Snapshot.from_xcom(window)).drift

    @task(queue="mi250", pool="mi250", retries=1, execution_timeout=timedelta(hours=6))
    def train(window: dict[str, Any]) -> dict[str, Any]:
        from tide_lib.orchestration.cycle import train as train_cycle
        from tide_lib.orchestration.handoff import Snapshot

        return train_cycle(_config(), Snapshot.from_xcom(window)).to_xcom()

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def challenger_improved(trained: dict[str, Any]) -> bool:
        from tide_lib.orchestration.handoff import Trained

        return Trained.from_xcom(trained).improved

    @task
    def register(window: dict[str, Any], trained: dict[str, Any]) -> str:
        from tide_lib.orchestration.cycle import register as register_cycle
        from tide_lib.orchestration.handoff import Snapshot, Trained

        return register_cycle(_config(), Snapshot.from_xcom(window), Trained.from_xcom(trained))

    @task
    def evaluate(window: dict[str, Any], trained: dict[str, Any], version: str) -> dict[str, Any]:
        from tide_lib.orchestration.cycle import evaluate_and_gate
        from tide_lib.orchestration.handoff import Snapshot, Trained

        config, snap = _config(), Snapshot.from_xcom(window)
        return evaluate_and_gate(config, snap, Trained.from_xcom(trained), version).to_xcom()

    @task(retries=0)
    def promote(version: str, decision: dict[str, Any]) -> dict[str, Any]:
        from tide_lib.orchestration.cycle import promote as promote_cycle
        from tide_lib.orchestration.handoff import Decision

        return promote_cycle(_config(), version, Decision.from_xcom(decision)).to_xcom()

    @task(trigger_rule="none_failed")  # also after a skipped (no drift, no gain) cycle
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

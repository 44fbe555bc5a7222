"""Train only when it pays: the cycle's headroom check, on the real stack.

The champion is replayed on the window and each segment compared with an estimate of
what a draft reaches there (``headroom.json``): its ceiling until a cycle trained on it,
then what was reached there plus half the last gain. The verdict is decided once per
cycle and read back on a rerun; what a cycle's training gained is kept for the next check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.orchestration.test_cycle_retries import _capture, _config
from tide_lib.config import TideConfig
from tide_lib.evaluation.gate import GateDecision, decision_tags
from tide_lib.names import Tags
from tide_lib.orchestration import cycle, drift_check, export, state
from tide_lib.orchestration.handoff import Drift
from tide_lib.registry import DraftRegistry

pytestmark = pytest.mark.slow


_SMALL_GAIN = GateDecision(  # a cycle's gate promoted it
    promote=True,
    reason="gain",
    challenger={"cluster-0": 2.0},
    champion={"cluster-0": 1.9},
    weights={"cluster-0": 1.0},
    weighted_challenger=2.0,
    weighted_champion=1.9,
    protected=("cluster-0",),
)


def _drift_config(stack: TideConfig, tmp_path: Path, tiny_target: Path) -> TideConfig:
    config = _config(stack, tmp_path, target_path=tiny_target, segment_clusters=1)
    return config.model_copy(update={"gate": config.gate.model_copy(update={"k": 3})})


def _never_drifting(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> tuple[TideConfig, DraftRegistry, str]:
    """A config whose drift tolerance no figure exceeds, its registry and a seeded champion."""
    config = _drift_config(stack, tmp_path, tiny_target)
    config = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"drift_tolerance": 10.0})}
    )
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    return config, registry, registry.seed_champion(tiny_drafts["ko"]).version


def test_traffic_never_trained_on_is_probed_then_only_headroom_trains(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    config = _drift_config(stack, tmp_path, tiny_target)
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    champion = registry.seed_champion(tiny_drafts["ko"]).version

    # No cycle trained on this traffic yet: it is estimated at its ceiling, and probed.
    _capture(config, tiny_target, documents=12)
    first = cycle.snapshot_window(config, "c1")
    probe = cycle.check_drift(config, first)
    assert probe.drift and "headroom on" in probe.reason and probe.champion_version == champion
    assert probe.margins and set(probe.margins) <= set(probe.measured)
    assert probe.baseline == probe.ceilings  # the estimate: what output lengths allow
    assert probe.drifted == sorted(probe.measured) and probe.fitting is None  # learn it all
    assert not probe.consolidate and not probe.champion_judged  # a seeded champion
    assert probe.segmenter_key == state.segmenter_key(config, "c1")
    assert cycle.check_drift(config, first) == probe  # decided once, read back on a rerun
    assert set(drift_check.read_headroom(config).reached) == set(probe.measured)

    # Its training gained nothing there: what was reached is the estimate, no headroom.
    drift_check.record_trial(config, "c1", {}, gain=0.0)
    assert drift_check.read_headroom(config).last_gain == dict.fromkeys(probe.drifted, 0.0)
    cycle.advance_watermark(config, first)
    _capture(config, tiny_target, documents=12)
    second = cycle.snapshot_window(config, "c2")
    fits = cycle.check_drift(config, second)
    assert not fits.drift and "no headroom" in fits.reason
    assert fits.saved_train_seconds is None or fits.saved_train_seconds >= 0
    cycle.advance_watermark(config, second)

    # A cycle that gained a lot there: the next one trains again (half as much expected).
    drift_check.record_trial(config, "c1", dict.fromkeys(probe.drifted, 1.0), gain=0.0)
    learning = drift_check.read_headroom(config)
    assert all(learning.reached[s] >= probe.measured[s] + 1.0 - 1e-9 for s in probe.drifted)
    _capture(config, tiny_target, documents=12)
    third = cycle.check_drift(config, cycle.snapshot_window(config, "c3"))
    assert third.drift and third.drifted == probe.drifted  # served below what was reached


def test_without_a_champion_or_with_the_check_off_the_cycle_trains(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    config = _drift_config(stack, tmp_path, tiny_target)
    _capture(config, tiny_target, documents=4)
    snapshot = cycle.snapshot_window(config, "c1")
    assert cycle.check_drift(config, snapshot).reason == "training: no champion yet"

    off = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"skip_without_drift": False})}
    )
    DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id).seed_champion(
        tiny_drafts["ko"]
    )
    verdict = cycle.check_drift(off, cycle.snapshot_window(off, "c2"))
    assert verdict.drift and "skip_without_drift is off" in verdict.reason

    forced = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"force_promote": True})}
    )
    verdict = cycle.check_drift(forced, cycle.snapshot_window(forced, "c3"))
    assert verdict.drift and "force_promote is on" in verdict.reason


def test_a_cycle_whose_best_checkpoint_is_its_parent_registers_nothing(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    """Item 3: no challenger worse than its parent. Training that only makes things worse
    (a learning rate far too high) hands back the parent itself, marked not improved."""
    config = _drift_config(stack, tmp_path, tiny_target)
    config = config.model_copy(
        update={
            "training": config.training.model_copy(
                update={"learning_rate": 5.0, "warm_lr_scale": 1.0, "eval_every": 10_000}
            )
        }
    )
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    parent = registry.seed_champion(tiny_drafts["ko"]).version
    _capture(config, tiny_target, documents=12)
    snapshot = cycle.snapshot_window(config, "c1")
    # The check sent it to learn a segment its baseline held no figure for.
    check = Drift(
        drift=True,
        reason="far below its best",
        champion_version=parent,
        measured={"cluster-0": 1.0},
        margins={"cluster-0": 0.1},
        baseline={},
        drifted=["cluster-0"],
        champion_judged=False,
    )
    state.write_state(config, "cycles/c1/drift.json", check.model_dump_json().encode())

    trained = cycle.train(config, snapshot)
    assert trained.improved is False and trained.parent_version == parent
    # Learned in vain: what it gained is the segment's last gain, and little is expected.
    gained = drift_check.read_headroom(config).last_gain
    assert set(gained) == {"cluster-0"} and gained["cluster-0"] <= config.cycle.drift_tolerance
    assert trained.draft_uri == registry.model_uri(parent)
    assert cycle.train(config, snapshot) == trained  # a retry reads the outcome back
    run = registry.client.get_run(trained.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["tide.best_is_parent"] == "true"
    # what its best step learned per segment, which the trial reads: nothing worth keeping
    learned = json.loads(run.data.tags["tide.learned_gains"])
    assert all(gain <= config.cycle.drift_tolerance for gain in learned.values())
    # Issue 15: the lake window it read is the run's MLflow dataset input.
    (dataset_input,) = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert dataset.name == f"lake-{config.cycle.target_id}-c1" and len(dataset.digest) == 16
    assert json.loads(dataset.source)["uri"].endswith("cycles/c1.json")
    assert json.loads(dataset.profile)["window_tokens"] == snapshot.window_tokens > 0
    assert {(t.key, t.value) for t in dataset_input.tags} == {("mlflow.data.context", "training")}
    assert [
        v.version for v in registry.client.search_model_versions(f"name = '{registry.name}'")
    ] == [parent]

    # cycle.force_promote (demos, tests of the promotion path) keeps the last step instead
    forced = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"force_promote": True})}
    )
    last = cycle.train(forced, cycle.snapshot_window(forced, "c2"))
    assert last.improved and last.draft_uri != registry.model_uri(parent)


def test_the_gate_judges_against_the_baseline_draft_on_the_same_requests(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    """``baseline`` stays on the first champion; a later challenger is replayed against it
    too (``gate.floor``), on the very requests it and the champion are judged on."""
    from tide_lib.orchestration.handoff import Trained
    from tide_lib.registry import BASELINE

    config = _drift_config(stack, tmp_path, tiny_target)
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    first = registry.seed_champion(tiny_drafts["en"], cycle_id="first").version
    registry.seed_champion(tiny_drafts["ko"], cycle_id="second")  # champion; first: baseline
    _capture(config, tiny_target, documents=12)
    snapshot = cycle.snapshot_window(config, "c1")
    trained = Trained(run_id="r", draft_uri="runs:/r/draft", parent_version=None)

    def judged(cycle_id: str, gate: dict[str, Any]) -> dict[str, str]:
        run = registry.client.create_run(registry.experiment_id()).info.run_id
        challenger = registry.register(tiny_drafts["en"], run, cycle_id=cycle_id).version
        judged_config = config.model_copy(update={"gate": config.gate.model_copy(update=gate)})
        cycle.evaluate_and_gate(judged_config, snapshot, trained, challenger)
        return registry.get(challenger).tags

    tags = judged("c1", {})
    assert registry.alias(BASELINE).version == first
    assert tags[Tags.FLOOR_VERSION] == first
    floor = {key: value for key, value in tags.items() if key.startswith("tide.gate.floor_al.")}
    # the challenger is the baseline's own draft: equal figures, request for request
    assert floor and all(
        tags[key.replace("tide.gate.floor_al.", "tide.al.")] == value
        for key, value in floor.items()
    )
    off = judged("c1-off", {"floor": False})
    assert Tags.FLOOR_VERSION not in off and not any("floor_al" in key for key in off)


def test_a_warm_started_champion_with_headroom_trains_one_consolidation_cycle_on_every_segment(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    """A chain of warm starts learns each segment from its own windows, one after the
    other. The next cycle that trains a champion a warm start promoted learns them all at
    once (``cycle.consolidate``): older traffic is learned, not replayed, for up to
    ``cycle.consolidate_max_steps``; the version it registers is tagged. Without headroom
    nothing trains, and nothing consolidates."""
    config, registry, seeded = _never_drifting(stack, tmp_path, tiny_target, tiny_drafts)
    config = config.model_copy(
        update={
            "cycle": config.cycle.model_copy(
                update={"consolidate_max_steps": 7, "consolidate_from": "champion"}
            ),
            "training": config.training.model_copy(update={"warm_max_steps": 3, "export": "last"}),
        }
    )
    _capture(config, tiny_target, documents=6)  # older traffic in the lookback
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c0"))
    _capture(config, tiny_target, documents=6, skip=6)
    gate_segmenter = state.cycle_segmenter(config, cycle.snapshot_window(config, "c1"))[1]

    judged = {  # as evaluate_and_gate tags a promoted version
        **decision_tags(_SMALL_GAIN, config.gate.k),
        Tags.SEGMENTER: gate_segmenter,
        Tags.GATE_REPLAY: drift_check.REPLAY_RULE,
    }

    def promoted(parent: str, cycle_id: str) -> str:
        version = registry.seed_champion(tiny_drafts["ko"], cycle_id).version
        registry.set_tags(version, {**judged, Tags.PARENT_VERSION: parent})
        return version

    end = promoted(seeded, "chain-1")
    alone = cycle.check_drift(config, cycle.snapshot_window(config, "c1"))
    assert not alone.drift and not alone.consolidate and "no headroom" in alone.reason

    room = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"drift_tolerance": 0.1})}
    )
    snapshot = cycle.snapshot_window(room, "c2")
    check = cycle.check_drift(room, snapshot)
    assert check.drift and check.consolidate and "was warm-started" in check.reason
    assert check.champion_version == end and check.fitting is None

    # Every segment's older requests are learned with the window's; nothing is replayed.
    together = export.export_training_data(config, snapshot, tmp_path / "together").as_params()
    drift_json = "cycles/c2/drift.json"
    # the same check as a warm start that names no segment: older traffic is replayed
    plain = check.model_copy(update={"consolidate": False, "drifted": []})
    state.write_state(config, drift_json, plain.model_dump_json().encode())
    apart = export.export_training_data(config, snapshot, tmp_path / "apart").as_params()
    state.write_state(config, drift_json, check.model_dump_json().encode())
    assert apart["trained_replay_requests"] > 0 and together["trained_replay_requests"] == 0
    learned_apart = apart["trained_window_requests"] + apart["trained_replay_requests"]
    assert together["trained_window_requests"] >= learned_apart
    assert together["trained_window_requests"] > apart["trained_window_requests"]

    trained = cycle.train(config, snapshot)
    run = registry.client.get_run(trained.run_id)
    assert run.data.params["trained_steps"] == "7"  # not training.warm_max_steps
    assert run.data.params["trained_replay_requests"] == "0"
    assert run.data.params["started_from"] == f"v{end}"
    # From the gate's floor instead (the seeded draft); the champion stays the one to beat.
    from_floor = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"consolidate_from": "baseline"})}
    )
    again = cycle.snapshot_window(from_floor, "c2b")
    state.write_state(config, "cycles/c2b/drift.json", check.model_dump_json().encode())
    floor_run = registry.client.get_run(cycle.train(from_floor, again).run_id)
    assert floor_run.data.params["started_from"] == f"baseline v{seeded}"
    assert floor_run.data.params["trained_steps"] == "7"  # the consolidation's cap
    assert floor_run.data.tags[Tags.PARENT_VERSION] == end
    version = cycle.register(config, snapshot, trained)
    assert registry.get(version).tags[Tags.CONSOLIDATED] == "true"
    assert Tags.CONSOLIDATED not in registry.get(end).tags
    assert registry.find("999") is None  # a parent retention deleted: no chain, no error

    # Promoted, the consolidated draft is no warm start: it consolidates only because every
    # cycle that trains a promoted champion does (cycle.consolidate_each_drift).
    registry.promote(version)
    registry.set_tags(version, judged)
    cycle.advance_watermark(config, snapshot)
    _capture(config, tiny_target, documents=6, skip=12)
    after = cycle.check_drift(room, cycle.snapshot_window(room, "c3"))
    assert after.champion_version == version
    assert after.drift and after.consolidate and "consolidate_each_drift" in after.reason

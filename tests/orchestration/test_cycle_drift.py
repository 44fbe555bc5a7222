"""Train only when it pays (issue 14, item 5): the cycle's drift check, on the real stack.

The champion is replayed on the window and compared with its baseline. A seeded
champion (never judged by the gate) takes its first measurement as baseline, so
traffic like the one it serves is "no drift"; a segment that falls below its
baseline by more than ``cycle.drift_tolerance`` is drift. The verdict is decided
once per cycle and read back on a rerun.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.orchestration.test_cycle_retries import _capture, _config
from tide_lib.config import TideConfig
from tide_lib.evaluation.drift import judge_drift
from tide_lib.evaluation.gate import GateDecision, decision_tags
from tide_lib.evaluation.offline import length_margin
from tide_lib.names import Tags
from tide_lib.orchestration import cycle, drift_check, export, state
from tide_lib.orchestration.handoff import Drift
from tide_lib.registry import DraftRegistry

pytestmark = pytest.mark.slow


_SMALL_GAIN = GateDecision(  # a promotion below cycle.learning_gain: not still learning
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


def test_a_champion_that_still_fits_skips_training_and_a_fall_is_drift(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    config = _drift_config(stack, tmp_path, tiny_target)
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    champion = registry.seed_champion(tiny_drafts["ko"]).version

    _capture(config, tiny_target, documents=12)
    first = cycle.snapshot_window(config, "c1")
    never_judged = cycle.check_drift(config, first)
    assert never_judged.drift and "had no baseline" in never_judged.reason
    assert not never_judged.consolidate  # a seeded champion's first check: nothing shifted
    assert never_judged.margins and set(never_judged.margins) <= set(never_judged.measured)
    # A retry of that check (its record lost) must not compare the window with itself.
    state.lake_store(config).remove(drift_check.drift_key(config, "c1"))
    assert cycle.check_drift(config, first).drift
    cycle.advance_watermark(config, first)

    # Its first measurement (segments of two requests or more) is its baseline: the same
    # traffic again is no drift, and the cycle trains nothing (a workload without shift).
    own = cycle.cycle_segmenter(config, first)[0]
    segments = drift_check._window_sample(config, first, own, own)[1]
    _capture(config, tiny_target, documents=12)
    second = cycle.snapshot_window(config, "c2")
    verdict = cycle.check_drift(config, second)
    assert not verdict.drift and "no drift" in verdict.reason
    assert verdict.champion_version == champion and set(verdict.measured) == set(segments)
    # Grouped as its baseline was (c1's clusters), although c2 refits its own.
    assert verdict.segmenter_key == never_judged.segmenter_key == state.segmenter_key(config, "c1")
    first_figures = {
        s: never_judged.measured[s] for s in never_judged.margins if s not in never_judged.drifted
    }
    assert verdict.baseline == first_figures
    assert cycle.check_drift(config, second) == verdict  # decided once, read back on a rerun
    cycle.advance_watermark(config, second)

    # Its baseline was higher than it now serves: the window has drifted.
    raised = {s: v + 2 * config.cycle.drift_tolerance for s, v in verdict.measured.items()}
    drift_check.store_baseline(
        config, drift_check.Baseline(champion, raised, {}, verdict.segmenter_key), "gate"
    )
    _capture(config, tiny_target, documents=12)
    third = cycle.snapshot_window(config, "c3")
    drifted = cycle.check_drift(config, third)
    assert drifted.drift and "fell by more than" in drifted.reason
    assert drifted.baseline == raised and drifted.saved_train_seconds is None
    # Every drift consolidates (cycle.consolidate_each_drift), a seeded champion's too.
    assert drifted.consolidate and "drifted (cycle.consolidate_each_drift)" in drifted.reason
    # Off, only a champion a warm start promoted consolidates; a retry checks again.
    chains_only = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"consolidate_each_drift": False})}
    )
    store = state.lake_store(config)
    store.remove(drift_check.drift_key(config, "c3"))
    store.remove(state.state_key(config, "consolidation.json"))
    warm = cycle.check_drift(chains_only, third)
    assert warm.drift and not warm.consolidate and warm.drifted == drifted.drifted
    assert warm.fitting == []  # every segment fell: the cycle learns the whole window
    cycle.advance_watermark(config, third)

    # Had a cycle's warm start promoted it, the cycle that trains on it consolidates; once.
    registry.set_tags(champion, decision_tags(_SMALL_GAIN, config.gate.k))

    def fallen(cycle_id: str) -> Drift:
        baseline = drift_check.Baseline(champion, raised, {}, verdict.segmenter_key)
        drift_check.store_baseline(config, baseline, "gate")
        _capture(config, tiny_target, documents=12)
        snapshot = cycle.snapshot_window(config, cycle_id)
        found = cycle.check_drift(config, snapshot)
        cycle.advance_watermark(config, snapshot)
        return found

    consolidating = fallen("c4")
    assert consolidating.drift and consolidating.consolidate
    assert "was warm-started (drift: " in consolidating.reason
    assert consolidating.drifted and consolidating.champion_version == champion
    # Its consolidation replaced nothing (the champion is still it): a warm start again.
    again = fallen("c5")
    assert again.drift and not again.consolidate and "fell by more than" in again.reason


def test_a_promotion_for_a_large_gain_trains_once_more_then_the_drift_rule_decides(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    # Whatever the tiny draft measures, no drift: the one-more-cycle rule is what decides.
    config, registry, champion = _never_drifting(stack, tmp_path, tiny_target, tiny_drafts)
    promoted = GateDecision(
        promote=True,
        reason="gain",
        challenger={"cluster-0": 2.5, "cluster-1": 2.0},
        champion={"cluster-0": 1.5, "cluster-1": 1.9},
        weights={"cluster-0": 0.6, "cluster-1": 0.4},
        weighted_challenger=2.3,
        weighted_champion=1.66,
        protected=("cluster-0", "cluster-1"),
    )
    _capture(config, tiny_target, documents=6)
    first = cycle.snapshot_window(config, "c1")
    gate_segmenter = state.cycle_segmenter(config, first)[1]  # what its gate grouped by
    registry.set_tags(
        champion,
        {
            **decision_tags(promoted, config.gate.k),
            Tags.SEGMENTER: gate_segmenter,
            Tags.GATE_REPLAY: drift_check.REPLAY_RULE,  # as evaluate_and_gate tags it
        },
    )
    learning = cycle.check_drift(config, first)
    assert learning.drift and "still being learned" in learning.reason
    assert "no drift" in learning.reason  # checked after the drift rule
    assert learning.drifted == ["cluster-0"]  # what it gained on
    assert learning.segmenter_key == gate_segmenter
    # A cycle promoted it: the cycle that trains on it again learns everything together.
    assert learning.consolidate and "was warm-started" in learning.reason
    # A retry of that check (its record lost) is still the first check since the promotion,
    # and still the cycle that consolidates on it.
    state.lake_store(config).remove(drift_check.drift_key(config, "c1"))
    assert cycle.check_drift(config, first).consolidate
    # With cycle.consolidate off it warm-starts: what it gained on is learned, the rest kept.
    state.lake_store(config).remove(drift_check.drift_key(config, "c1"))
    off = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"consolidate": False})}
    )
    retried = cycle.check_drift(off, first)
    assert retried.drifted == ["cluster-0"] and not retried.consolidate
    cycle.advance_watermark(config, first)

    # The cycle after its first check: only drift trains it now.
    _capture(config, tiny_target, documents=6)
    second = cycle.snapshot_window(config, "c2")
    judged = cycle.check_drift(config, second)
    assert not judged.drift and "still being learned" not in judged.reason
    assert judged.champion_version == champion
    assert promoted.challenger.items() <= judged.baseline.items()
    assert judged.segmenter_key == gate_segmenter  # grouped as its baseline was
    # Figures an older release's gate tagged (engine rounds, another replay) are no baseline.
    state.lake_store(config).remove(state.state_key(config, "baseline.json"))
    registry.set_tags(champion, {Tags.GATE_REPLAY: "engine_rounds"})
    older = drift_check.champion_baseline(config, registry, registry.get(champion))
    assert older.accept_length == {}


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
    # Learned in vain: the segment is held to what the parent serves there from now on.
    key = state.state_key(config, "baseline.json")
    settled = json.loads(state.lake_store(config).get_bytes(key))
    assert settled["accept_length"] == {"cluster-0": 1.0} and settled["version"] == parent
    assert trained.draft_uri == registry.model_uri(parent)
    assert cycle.train(config, snapshot) == trained  # a retry reads the outcome back
    run = registry.client.get_run(trained.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["tide.best_is_parent"] == "true"
    # what its best step learned per segment, which settling reads: nothing worth keeping
    learned = json.loads(run.data.tags["tide.learned_gains"])
    assert all(gain < config.cycle.learning_gain for gain in learned.values())
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


def test_a_first_measurement_keeps_traffic_it_does_not_fit_out_of_its_baseline(
    stack: TideConfig, tmp_path: Path, tiny_target: Path
) -> None:
    """Measured first on a window where new traffic already arrived, the champion's figure
    on that traffic must not become its standard: later windows of it would read as "no
    drift" and never be learned (seen in the four-segment adaptation benchmark)."""
    config = _drift_config(stack, tmp_path, tiny_target)
    window = drift_check._Window(
        measured={"english": 3.0, "korean": 1.4, "single": 2.95},
        margins={"english": 0.1, "korean": 0.1},
        all_margins={"english": 0.1, "korean": 0.1, "single": float("inf")},
        shares={"english": 0.5, "korean": 0.4, "single": 0.1},
        segmenter_key="segmenter-key",
    )
    first = drift_check._first_measurement(config, "1", window, "c1")
    assert first.drift and first.drifted == ["korean"]
    assert first.fitting == ["english"]  # kept; korean and the unmeasurable one learned
    stored = json.loads(
        state.lake_store(config).get_bytes(state.state_key(config, "baseline.json"))
    )
    assert stored["accept_length"] == {"english": 3.0} and stored["margins"] == {"english": 0.1}
    # Every segment fits: a cycle that trains anyway learns its whole window.
    fits = drift_check._Window(
        measured={"english": 3.0},
        margins={"english": 0.1},
        all_margins={"english": 0.1},
        shares={"english": 1.0},
        segmenter_key="segmenter-key",
    )
    assert drift_check._first_measurement(config, "1", fits, "c1").fitting is None
    # Traffic at its ceiling (answered in a token or two) is neither learned nor a standard.
    short = drift_check._Window(
        measured={"english": 3.0, "law": 1.1},
        margins={"english": 0.1, "law": 0.05},
        all_margins={"english": 0.1, "law": 0.05},
        shares={"english": 0.5, "law": 0.5},
        segmenter_key="segmenter-key",
        ceilings={"english": 4.0, "law": 1.15},
    )
    capped = drift_check._first_measurement(config, "1", short, "c1")
    assert capped.drifted == [] and capped.fitting is None and capped.ceilings == short.ceilings
    stored = json.loads(
        state.lake_store(config).get_bytes(state.state_key(config, "baseline.json"))
    )
    assert stored["accept_length"] == {"english": 3.0}
    # At its ceiling on too few requests to know a margin, or with a wide one: still kept.
    loose = dataclasses.replace(
        short,
        margins={"english": 0.1},
        all_margins={"english": 0.1, "law": float("inf")},
        ceilings={"english": 4.0, "law": 1.1},
    )
    assert drift_check._first_measurement(config, "1", loose, "c1").fitting is None


def test_a_champion_promoted_without_a_protected_segment_trains_only_for_traffic_it_does_not_fit(
    stack: TideConfig, tmp_path: Path
) -> None:
    """A champion a cycle promoted on its window-weighted figure alone (no segment held
    out enough to count) has no baseline either; unlike a seeded one it was judged on
    the traffic it was trained for, so its first measurement trains only when a segment
    is far below its best beyond the margin of error (seen in the no-shift benchmark:
    every cycle after a promotion trained, for a draft the gate then rejected)."""
    config = _config(stack, tmp_path, segment_clusters=1)
    window = drift_check._Window(
        measured={"english": 3.0, "korean": 1.4, "docs": 2.9},
        margins={"english": 0.1, "korean": 0.1, "docs": 0.2},
        all_margins={"english": 0.1, "korean": 0.1, "docs": 0.2},
        shares={"english": 0.5, "korean": 0.3, "docs": 0.2},
        segmenter_key="segmenter-key",
    )
    new_traffic = drift_check._first_measurement(config, "2", window, "c1", promoted=True)
    assert new_traffic.drift and new_traffic.drifted == ["korean"]
    assert "serves korean below its best segment" in new_traffic.reason
    # The same figures with a margin as wide as the fall: no evidence of new traffic.
    loose = dataclasses.replace(
        window,
        margins={**window.margins, "korean": 1.6},
        all_margins={**window.all_margins, "korean": 1.6},
    )
    fits = drift_check._first_measurement(config, "2", loose, "c2", promoted=True)
    assert not fits.drift and fits.drifted == [] and "no drift" in fits.reason
    stored = json.loads(
        state.lake_store(config).get_bytes(state.state_key(config, "baseline.json"))
    )
    assert stored["accept_length"] == {"english": 3.0, "docs": 2.9}  # its standard from now on
    assert stored["version"] == "2" and stored["cycle_id"] == "c2"
    # A small segment served perfectly is no standard for the traffic the champion serves.
    lucky = dataclasses.replace(
        loose,
        measured={**loose.measured, "tiny": 4.8},
        margins={**loose.margins, "tiny": 0.0},
        all_margins={**loose.all_margins, "tiny": 0.0},
        shares={**loose.shares, "tiny": 0.05},
    )
    assert not drift_check._first_measurement(config, "2", lucky, "c5", promoted=True).drift
    stored = json.loads(
        state.lake_store(config).get_bytes(state.state_key(config, "baseline.json"))
    )
    assert stored["accept_length"] == {"english": 3.0, "docs": 2.9}  # nor its standard later
    # Seeded, the same loose figures train: it was never judged on any traffic.
    seeded = drift_check._first_measurement(config, "1", loose, "c3")
    assert seeded.drift and seeded.drifted == ["korean"]
    # Nothing measurable on two requests: it cannot judge, so it trains.
    single = drift_check._Window(
        measured={"english": 3.0},
        margins={},
        all_margins={"english": float("inf")},
        shares={"english": 1.0},
        segmenter_key="segmenter-key",
    )
    assert drift_check._first_measurement(config, "2", single, "c4", promoted=True).drift


def test_the_check_after_a_thin_promotion_measures_instead_of_training(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    config, registry, champion = _never_drifting(stack, tmp_path, tiny_target, tiny_drafts)
    small_gain = dataclasses.replace(
        _SMALL_GAIN,
        reason="window-weighted gain",
        protected=(),  # too little held-out traffic to protect any segment alone
    )
    registry.set_tags(champion, decision_tags(small_gain, config.gate.k))
    _capture(config, tiny_target, documents=6)
    first = cycle.snapshot_window(config, "c1")
    measured = cycle.check_drift(config, first)
    assert not measured.drift and "promoted without a baseline" in measured.reason
    assert measured.champion_version == champion and measured.measured
    assert measured.saved_train_seconds is None  # no cycle has trained in this registry
    cycle.advance_watermark(config, first)

    # Its figures are its baseline now: the next window is judged against them.
    _capture(config, tiny_target, documents=6)
    second = cycle.snapshot_window(config, "c2")
    judged = cycle.check_drift(config, second)
    assert not judged.drift and judged.baseline and "vs baseline" in judged.reason

    # Promoted for a large window-weighted gain, the first check trains once more.
    large_gain = dataclasses.replace(small_gain, weighted_challenger=3.0)
    registry.set_tags(champion, decision_tags(large_gain, config.gate.k))
    state.lake_store(config).remove(drift_check.drift_key(config, "c2"))
    state.lake_store(config).remove(state.state_key(config, "baseline.json"))
    state.lake_store(config).remove(state.state_key(config, "learning.json"))
    learning = cycle.check_drift(config, second)
    assert learning.drift and "still being learned" in learning.reason
    assert "promoted without a baseline" in learning.reason


def test_a_segment_learned_in_vain_is_held_to_what_the_champion_serves_there(
    stack: TideConfig, tmp_path: Path, tiny_drafts: dict[str, Path]
) -> None:
    """Seen in the no-shift benchmark at abbe80c: a cluster the fitted draft serves at 2.6,
    left out of its first measurement (far below its best), was held to the baseline's
    4.3 ever after: three cycles trained, none promoted. A cycle that learns such a
    segment and keeps its champion settles it; one that gained on it, or a known segment
    that fell, is learned again."""
    config = _config(stack, tmp_path, segment_clusters=1)
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    champion = registry.seed_champion(tiny_drafts["ko"]).version
    window = drift_check._Window(
        measured={"chat": 4.3, "code": 2.6, "single": 2.0},
        margins={"chat": 0.1, "code": 0.15},
        all_margins={"chat": 0.1, "code": 0.15, "single": float("inf")},
        shares={"chat": 0.6, "code": 0.3, "single": 0.1},
        segmenter_key="key-1",
    )
    first = drift_check._first_measurement(config, champion, window, "c1")
    assert first.drifted == ["code", "single"] and not first.champion_judged
    # Never judged, the seeded champion's segments are learned, but a gain over it must
    # be beyond the noise: a segment far below its best may be traffic no draft serves
    # better (the first-cycle challengers registered below their parent).
    state.write_state(config, "cycles/c1/drift.json", first.model_dump_json().encode())
    assert cycle._training_settings(config, "c1").warm_gain == config.training.warm_gain
    judged = first.model_copy(update={"champion_judged": True})
    state.write_state(config, "cycles/c2/drift.json", judged.model_dump_json().encode())
    assert cycle._training_settings(config, "c2").warm_gain == "any"

    def settle(cycle_id: str, **gains: Any) -> list[str]:
        return drift_check.settle_tried_segments(config, registry, cycle_id, champion, **gains)

    def baseline() -> dict[str, Any]:
        key = state.state_key(config, "baseline.json")
        return dict(json.loads(state.lake_store(config).get_bytes(key)))

    # The gate measured a gain of learning_gain on it (grouped alike): learned, not settled.
    learned = {"code": 0.3, "chat": -0.2}
    assert settle("c1", gain=-0.1, segment_gains=learned, gains_key="key-1") == []
    # Grouped otherwise, another fit's clusters say nothing of these segments: the
    # window-weighted gain speaks for them; a client label names the same traffic.
    assert settle("c1", gain=0.3, segment_gains={"cluster-0": 0.0}, gains_key="key-2") == []
    assert settle("c1", gain=0.0, segment_gains={"code": 0.3}, gains_key="key-2") == []
    assert baseline()["accept_length"] == {"chat": 4.3}
    assert settle("c9", gain=0.0) == []  # no check saved for that cycle
    # No checkpoint beat the parent (or the gate found no gain there): held to its figure.
    assert settle("c1", gain=0.05) == ["code"]  # one request gives no figure to hold
    stored = baseline()
    assert stored["accept_length"] == {"chat": 4.3, "code": 2.6}
    assert stored["margins"] == {"chat": 0.1, "code": 0.15}
    assert stored["segmenter"] == "key-1" and stored["version"] == champion
    known = drift_check.champion_baseline(config, registry, registry.get(champion))
    later = dataclasses.replace(window, measured={"chat": 4.25, "code": 2.5, "single": 2.0})
    assert not drift_check._judged_against(config, champion, later, known).drift
    # A known segment that fell is traffic that changed: its baseline stays.
    fell = drift_check._judged_against(
        config, champion, dataclasses.replace(later, measured={"chat": 3.5, "code": 2.5}), known
    )
    assert fell.drift and fell.drifted == ["chat"]
    state.write_state(config, "cycles/c3/drift.json", fell.model_dump_json().encode())
    assert settle("c3", gain=0.0) == []
    assert baseline()["accept_length"] == stored["accept_length"]

    # Each segment fell within its margin of error (four requests each), the window as a
    # whole beyond it: drift (a new language's first window read "no drift" so).
    requests = {
        "chat": [(21, 5), (16, 5), (20, 5), (17, 5)],
        "code": [(12, 5), (9, 5), (11, 5), (8, 5)],
    }
    spread = dataclasses.replace(
        later,
        measured={"chat": 3.7, "code": 2.0},
        margins={s: length_margin(pairs) for s, pairs in requests.items()},
        all_margins={s: length_margin(pairs) for s, pairs in requests.items()},
        shares={"chat": 0.5, "code": 0.5},
        per_request=requests,
    )
    alone = judge_drift(
        spread.measured,
        spread.shares,
        known.accept_length,
        tolerance=config.cycle.drift_tolerance,
        min_share=config.gate.min_segment_share,
        margins=spread.margins,
        baseline_margins=known.margins,
    )
    assert not alone.drift
    whole = drift_check._judged_against(config, champion, spread, known)
    assert whole.drift and "the window as a whole fell 0.600" in whole.reason
    assert whole.drifted == ["chat", "code"] and "by segment, no drift" in whole.reason
    assert baseline()["accept_length"] == stored["accept_length"]  # drift grows no baseline


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


def test_the_end_of_a_learning_chain_trains_one_consolidation_cycle_on_every_segment(
    stack: TideConfig, tmp_path: Path, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    """A chain of warm starts learns each segment from its own windows, one after the
    other. The first check without drift after the chain's last promotion learns them all
    at once (``cycle.consolidate``; a check that trains a warm-started champion does so
    too, tested above): older traffic is learned, not replayed, for up to
    ``cycle.consolidate_max_steps``; the version it registers is tagged and ends the
    chain. A single promotion over a seeded draft without drift after it is no chain."""
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

    single = promoted(seeded, "chain-1")
    alone = cycle.check_drift(config, cycle.snapshot_window(config, "c1"))
    assert not alone.drift and not alone.consolidate and "no drift" in alone.reason

    end = promoted(single, "chain-2")
    snapshot = cycle.snapshot_window(config, "c2")
    check = cycle.check_drift(config, snapshot)
    assert check.drift and check.consolidate and "ends a learning chain" in check.reason
    assert check.champion_version == end and check.drifted == [] and check.fitting is None

    # Every segment's older requests are learned with the window's; nothing is replayed.
    together = export.export_training_data(config, snapshot, tmp_path / "together").as_params()
    drift_json = "cycles/c2/drift.json"
    plain = check.model_copy(update={"consolidate": False})  # the same check, no chain
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

    # Promoted, the consolidated draft's first check without drift starts no chain.
    registry.promote(version)
    registry.set_tags(version, judged)
    cycle.advance_watermark(config, snapshot)
    _capture(config, tiny_target, documents=6, skip=12)
    after = cycle.check_drift(config, cycle.snapshot_window(config, "c3"))
    assert after.champion_version == version
    assert not after.drift and not after.consolidate

"""The cycle groups held-out traffic by segment (issue 14), on the real S3 server.

Window and older held-out requests alike are grouped by the client's label, else by
the cycle's clusters; the gate's weights are the window's token shares; the cycle's
segmenter is stored once under its lake state and warm-starts the next cycle's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import make_record
from tide_lib.config import LakeConfig, TideConfig
from tide_lib.evaluation.offline import content_digest, content_fraction
from tide_lib.evaluation.segments import Segmenter
from tide_lib.lake import LakeWriter, ObjectStore, target_slug
from tide_lib.lake.schema import CapturedRecord
from tide_lib.orchestration import cycle, drift_check, export, state
from tide_lib.orchestration.export import HeldOutTraffic
from tide_lib.orchestration.handoff import Drift

pytestmark = pytest.mark.slow
TARGET = "demo/segments"
HIDDEN = 16


@pytest.fixture
def config(stack: TideConfig, lake_config: LakeConfig, tmp_path: Path) -> TideConfig:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "vocab_size": 1000}))
    return stack.model_copy(
        update={
            "lake": lake_config.model_copy(update={"commit_settle_s": 1.0}),
            "cycle": stack.cycle.model_copy(
                update={
                    "target_id": TARGET,
                    "target_path": target,
                    "held_out_percent": 50,
                    "held_out_older_tokens": 10_000,
                    "replay_share": 4.0,
                    "segment_clusters": 2,
                }
            ),
            "scratch_dir": tmp_path / "scratch",
        }
    )


def _record(
    index: int, center: np.ndarray, segment: str | None, tokens: int = 12
) -> CapturedRecord:
    """A request whose final states sit around ``center`` (the target's view of its kind)."""
    record = make_record(index, target_id=TARGET, hidden=HIDDEN, tokens=tokens)
    noise = np.random.default_rng(index).standard_normal(record.hidden_states.shape)
    states = (center[None] + 0.2 * noise).astype(np.float16)
    return dataclasses.replace(record, hidden_states=states, segment=segment)


def _write(store: ObjectStore, config: TideConfig, records: list[CapturedRecord]) -> None:
    with LakeWriter(store, config.lake) as writer:
        for record in records:
            assert writer.submit(record)
        assert writer.flush(timeout=30)
    time.sleep(1.5)  # commit_settle_s


CENTERS = [3.0 * np.random.default_rng(seed).standard_normal(HIDDEN) for seed in (1, 2)]


def _store_drift(
    store: ObjectStore, config: TideConfig, checked: dict[str, float], **verdict: Any
) -> Drift:
    """A drift check of champion v1 saved for cycle c2, which measured ``checked``
    (acceptance length per segment, each at its baseline, margin 0.05): drift unless
    ``verdict`` says otherwise."""
    verdict = {"drift": True, "champion_version": "1", **verdict}
    drift = Drift(
        reason="test",
        measured=checked,
        margins=dict.fromkeys(checked, 0.05),
        baseline=checked,
        **verdict,
    )
    store.put_bytes(drift_check.drift_key(config, "c2"), drift.model_dump_json().encode())
    return drift


def test_held_out_traffic_is_grouped_by_segment_with_window_and_older_shares(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    # Older traffic: English chat, labelled by its client.
    _write(lake_store, config, [_record(i, CENTERS[0], "english") for i in range(20)])
    first = cycle.snapshot_window(config, "c1")
    cycle.advance_watermark(config, first)
    # The window: Korean law (labelled), unlabelled requests of another kind, and the
    # last of the English.
    _write(
        lake_store,
        config,
        [_record(100 + i, CENTERS[0], "korean law") for i in range(10)]
        + [_record(200 + i, CENTERS[1], None) for i in range(30)]
        + [_record(300 + i, CENTERS[0], "english") for i in range(10)],
    )
    snapshot = cycle.snapshot_window(config, "c2")
    traffic = export.held_out_traffic(config, snapshot)

    (cluster,) = [name for name in traffic.window_tokens if name.startswith("cluster-")]
    assert traffic.window_tokens == {"korean law": 10 * 12, cluster: 30 * 12, "english": 120}
    assert traffic.window_shares == pytest.approx({"korean law": 0.2, cluster: 0.6, "english": 0.2})
    assert traffic.older_shares == {"english": 1.0}  # older traffic: English alone
    assert set(traffic.samples) == {"english", "korean law", cluster}
    held = {s.request_id for samples in traffic.samples.values() for s in samples}
    assert {s.request_id for s in traffic.samples[cluster]} <= {f"req-{200 + i}" for i in range(30)}
    assert 0 < len(held) < 70  # held out, not everything
    # Each segment's window requests come first: the gain is measured on them alone.
    english = [int(s.request_id.removeprefix("req-")) for s in traffic.samples["english"]]
    first = traffic.window_held_out["english"]
    assert 0 < first < len(english), english
    assert min(english[:first]) >= 300 and max(english[first:]) < 20
    assert traffic.window_held_out[cluster] == len(traffic.samples[cluster])
    assert export.held_out_samples(config, snapshot).keys() == traffic.samples.keys()

    # The segmenter is stored once under the cycle's state and read back as is.
    stored = Segmenter.from_json(lake_store.get_bytes(traffic.segmenter_key))
    assert traffic.segmenter_key == (
        f"{config.lake.prefix}/_state/target={target_slug(TARGET)}/cycles/c2/segmenter.json"
    )
    again, key = cycle.cycle_segmenter(config, snapshot)
    assert key == traffic.segmenter_key and again.cluster_ids == stored.cluster_ids


def test_the_next_cycle_keeps_the_cluster_names(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    _write(lake_store, config, [_record(i, CENTERS[i % 2], None) for i in range(30)])
    first = cycle.snapshot_window(config, "c1")
    names_before = export.held_out_traffic(config, first).window_tokens.keys()
    cycle.advance_watermark(config, first)
    _write(lake_store, config, [_record(300 + i, CENTERS[i % 2], None) for i in range(30)])
    second = cycle.snapshot_window(config, "c2")
    traffic = export.held_out_traffic(config, second)
    assert traffic.window_tokens.keys() == names_before and len(names_before) == 2


def test_export_separates_window_and_replay(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    _write(lake_store, config, [_record(i, CENTERS[0], "english") for i in range(10)])
    first = cycle.snapshot_window(config, "c1")
    cycle.advance_watermark(config, first)
    _write(lake_store, config, [_record(100 + i, CENTERS[1], None) for i in range(10)])
    snapshot = cycle.snapshot_window(config, "c2")
    assert snapshot.replay  # the older commit is drawn, its requests replay candidates
    exported = export.export_training_data(config, snapshot, tmp_path / "data")
    window = sorted((tmp_path / "data" / "window").glob("*.ckpt"))
    replay = sorted((tmp_path / "data" / "replay").glob("*.ckpt"))
    assert window and replay and exported.total == len(window) + len(replay)
    assert exported.requests == {"window": len(window), "replay": len(replay)}
    replayed = sum(torch.load(path, weights_only=True)["input_ids"].numel() for path in replay)
    assert exported.as_params()["trained_replay_tokens"] == replayed
    assert not list((tmp_path / "data").glob("*.ckpt"))  # nothing outside the parts
    # The held-out requests go along apart, to be scored, never trained on: the very
    # requests the gate judges the challenger on, the window's and the older traffic's.
    judged = sorted((tmp_path / "data" / "held_out").rglob("*.ckpt"))
    assert judged and {path.parent.name for path in judged} <= {"window", "replay", "older"}

    def digests(paths: list[Path]) -> set[bytes]:
        return {content_digest(torch.load(p, weights_only=True)["input_ids"]) for p in paths}

    reader = state.sample_reader(config)
    window_held = {
        content_digest(sample.input_ids)
        for held, sample, _digest in export._window_split(config, snapshot, reader)
        if held
    }
    gate = {
        content_digest(sample.input_ids)
        for samples in export.held_out_samples(config, snapshot).values()
        for sample in samples
    }
    assert digests(judged) == gate and window_held < gate  # older English judged too
    older_judged = sorted((tmp_path / "data" / "held_out" / "older").glob("*.ckpt"))
    assert digests(older_judged) == gate - window_held  # scored in groups of their own
    assert digests(judged).isdisjoint(digests(window + replay))
    # and how the gate figures the window, so the trainer keeps no step below its parent
    figure = json.loads((tmp_path / "data" / "gate_figure.json").read_text())
    shares = export.held_out_traffic(config, snapshot).window_shares
    assert figure["shares"] == pytest.approx(shares) and figure["k"] == config.gate.k
    assert figure["min_segment_tokens"] == config.gate.min_segment_tokens
    assert (figure["tolerance"], figure["net_gain"]) == (config.gate.tolerance, True)


def test_a_segment_of_short_requests_is_read_on_until_the_gate_can_judge_it(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    # Older traffic: long documents (100 output tokens) between short chat requests (6).
    older: list[CapturedRecord] = []
    for i in range(40):
        older += [_record(i, CENTERS[1], "docs", tokens=200), _record(500 + i, CENTERS[0], "chat")]
    _write(lake_store, config, older)
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    window = [_record(900 + i, CENTERS[1], "docs") for i in range(4)]
    _write(lake_store, config, window + [_record(950 + i, CENTERS[0], "chat") for i in range(6)])
    snapshot = cycle.snapshot_window(config, "c2")
    assert snapshot.older_listed == 1  # one older commit: drawn whole, in the order written

    def judged(min_tokens: int) -> tuple[HeldOutTraffic, list[int], list[int]]:
        """The gate's traffic with a budget of 600 tokens; the input tokens of the older
        documents and the output tokens of the older chat requests judged, in order."""
        gate = config.gate.model_copy(update={"min_segment_tokens": min_tokens})
        budget = config.cycle.model_copy(update={"held_out_older_tokens": 600})
        small = config.model_copy(update={"cycle": budget, "gate": gate})
        traffic = export.held_out_traffic(small, snapshot)

        def older(segment: str) -> list[CapturedRecord]:
            return traffic.samples[segment][traffic.window_held_out.get(segment, 0) :]

        docs = [int(sample.input_ids.numel()) for sample in older("docs")]
        return traffic, docs, [int(sample.loss_mask.sum()) for sample in older("chat")]

    # Documents fill the budget (three of them, 600 tokens), beside three chat requests.
    traffic, docs, chat = judged(min_tokens=1)
    assert sum(docs) == 600 and chat == [6, 6, 6]
    assert traffic.older_tokens == {"docs": 40 * 200, "chat": 40 * 12}  # every request read
    # Chat, judged on its window's requests and those three, is read on until it holds
    # the gate's minimum of output tokens; documents are not.
    in_window = traffic.output_tokens["chat"] - sum(chat)
    traffic, docs, chat = judged(min_tokens=in_window + 40)
    assert sum(docs) == 600 and sum(chat) >= 40 > sum(chat[:-1]), chat
    # and the export scores the trainer's steps on the very same requests
    small = config.model_copy(
        update={
            "cycle": config.cycle.model_copy(update={"held_out_older_tokens": 600}),
            "gate": config.gate.model_copy(update={"min_segment_tokens": in_window + 40}),
        }
    )
    export.export_training_data(small, snapshot, tmp_path / "data")
    exported = (tmp_path / "data" / "held_out" / "older").glob("*.ckpt")
    assert {
        content_digest(torch.load(path, weights_only=True)["input_ids"]) for path in exported
    } == {
        content_digest(sample.input_ids)
        for segment, samples in traffic.samples.items()
        for sample in samples[traffic.window_held_out.get(segment, 0) :]
    }
    # Reading on stops at twice the budget, however thin the segments still are.
    _, docs, chat = judged(min_tokens=10_000)
    assert 1200 <= sum(docs) + 12 * len(chat) < 1200 + 200


def test_a_thin_older_segment_is_judged_on_its_reserved_requests_too(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Older traffic: a few long documents and twenty short chat requests (6 output
    # tokens each); the window is documents alone, so chat is older traffic to keep.
    older = [_record(i, CENTERS[1], "docs", tokens=200) for i in range(5)]
    older += [_record(500 + i, CENTERS[0], "chat") for i in range(20)]
    _write(lake_store, config, older)
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    _write(lake_store, config, [_record(900 + i, CENTERS[1], "docs") for i in range(4)])
    snapshot = cycle.snapshot_window(config, "c2")
    percent = config.cycle.held_out_percent

    def band(record: CapturedRecord) -> float:
        return content_fraction(torch.as_tensor(record.input_ids)) * 100

    chat = [r for r in older if r.segment == "chat"]
    held = {content_digest(torch.as_tensor(r.input_ids)) for r in chat if band(r) < percent}
    reserved = [r for r in chat if percent <= band(r) < percent + 20]
    assert held and reserved  # the hash puts requests in both bands

    def judged_chat(reserve: int, min_tokens: int) -> tuple[TideConfig, set[bytes]]:
        changed = config.model_copy(
            update={
                "cycle": config.cycle.model_copy(update={"held_out_reserve_percent": reserve}),
                "gate": config.gate.model_copy(update={"min_segment_tokens": min_tokens}),
            }
        )
        samples = export.held_out_traffic(changed, snapshot).samples["chat"]
        return changed, {content_digest(sample.input_ids) for sample in samples}

    enough = 6 * len(held)
    # Held out on enough output tokens: chat is judged on its held-out requests alone.
    assert judged_chat(20, enough)[1] == held
    # Too few: its reserved requests are judged too, until it has the gate's minimum.
    changed, judged = judged_chat(20, enough + 6)
    assert held < judged and len(judged - held) == 1
    assert judged_chat(20, 10_000)[1] == held | {
        content_digest(torch.as_tensor(r.input_ids)) for r in reserved
    }
    assert judged_chat(0, 10_000)[1] == held  # the band off: held-out requests alone
    # The export scores the trainer's steps on those very requests and trains on none.
    export.export_training_data(changed, snapshot, tmp_path / "data")

    def exported(folder: str) -> set[bytes]:
        paths = (tmp_path / "data" / folder).glob("*.ckpt")
        return {content_digest(torch.load(p, weights_only=True)["input_ids"]) for p in paths}

    scored = exported("held_out/older")
    assert judged <= scored
    assert scored.isdisjoint(exported("replay") | exported("window"))
    # The gate judges the reserved requests the export set aside, whatever it would
    # choose itself now (a shard lost in between, a setting changed): never one trained.
    traffic = export.held_out_traffic(judged_chat(20, 10_000)[0], snapshot)
    assert {content_digest(s.input_ids) for s in traffic.samples["chat"]} == judged
    assert scored == {
        content_digest(sample.input_ids)
        for segment, samples in traffic.samples.items()
        for sample in samples[traffic.window_held_out.get(segment, 0) :]
    }
    # An unreadable list (a corrupt state file) does not stop the gate: it chooses as the
    # export would, and its warning names the file.
    for unreadable in (b"[not json", b"{}", b'["not hex"]'):
        caplog.clear()
        state.write_state(changed, export._reserved_name("c2"), unreadable)
        with caplog.at_level(logging.WARNING, logger=export.__name__):
            fallback = export.held_out_traffic(changed, snapshot)
        assert {content_digest(s.input_ids) for s in fallback.samples["chat"]} == judged
        assert "c2-reserved.json" in caplog.text


def test_the_replay_favours_the_segment_the_window_lost(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    # Older traffic: English chat mostly, some English docs; the window: English chat only.
    few = config.model_copy(update={"cycle": config.cycle.model_copy(update={"replay_share": 0.5})})
    older = [_record(i, CENTERS[0], "english") for i in range(30)]
    older += [_record(100 + i, CENTERS[1], "docs") for i in range(10)]
    _write(lake_store, few, older)
    cycle.advance_watermark(few, cycle.snapshot_window(few, "c1"))
    _write(lake_store, few, [_record(200 + i, CENTERS[0], "english") for i in range(20)])
    snapshot = cycle.snapshot_window(few, "c2")
    export.export_training_data(few, snapshot, tmp_path / "data")
    replayed = [
        torch.load(path, weights_only=True)["segment"]
        for path in (tmp_path / "data" / "replay").glob("*.ckpt")
    ]
    # A budget of 10 requests (half the window's 20 of 12 tokens). By volume docs would
    # get a quarter of it (2.5); the window lacks docs, so it weighs twice its volume
    # against English chat's once: 0.5 / 1.25 of the budget, 4 requests, English 6.
    candidates = sum(content_fraction(torch.from_numpy(r.input_ids)) >= 0.5 for r in older[30:])
    assert candidates >= 4  # held out at 50%: the docs the gate judges never train
    assert sorted(replayed) == ["docs"] * 4 + ["english"] * 6, replayed


def test_the_window_learns_every_segment_but_those_the_champion_still_fits(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    config = config.model_copy(  # no older replay: what is kept comes from the window
        update={"cycle": config.cycle.model_copy(update={"replay_share": 0.0})}
    )
    _write(lake_store, config, [_record(i, CENTERS[0], "english") for i in range(10)])
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    window = [_record(100 + i, CENTERS[0], "english") for i in range(10)]
    window += [_record(200 + i, CENTERS[1], "korean law") for i in range(10)]
    _write(lake_store, config, window)
    snapshot = cycle.snapshot_window(config, "c2")
    # The check fit English closely and could not judge Korean law (too few requests).
    _store_drift(lake_store, config, {"english": 3.0}, drifted=[], fitting=["english"])
    export.export_training_data(config, snapshot, tmp_path / "data")

    def segments(part: str) -> list[str]:
        files = (tmp_path / "data" / part).glob("*.ckpt")
        return sorted({torch.load(path, weights_only=True)["segment"] for path in files})

    assert segments("window") == ["korean law"]  # unjudged new traffic is learned
    assert segments("replay") == ["english"]  # what it still fits is kept


def test_a_window_without_the_segments_to_learn_is_learned_whole(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    """Sent to go on learning Korean law (still learning after a promotion), a cycle
    whose window holds English alone, which the champion fits, learns the English: kept
    whole, it would train on replay alone and could never beat its parent. The older
    Korean law it replays stays replay."""
    _write(lake_store, config, [_record(i, CENTERS[1], "korean law") for i in range(10)])
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    _write(lake_store, config, [_record(100 + i, CENTERS[0], "english") for i in range(10)])
    snapshot = cycle.snapshot_window(config, "c2")
    _store_drift(lake_store, config, {"english": 3.0}, drifted=["korean law"], fitting=["english"])
    exported = export.export_training_data(config, snapshot, tmp_path / "data")

    def segments(part: Path) -> list[str]:
        return sorted(torch.load(path, weights_only=True)["segment"] for path in part.glob("*"))

    learned, replayed = (
        segments(tmp_path / "data" / "window"),
        segments(tmp_path / "data" / "replay"),
    )
    assert learned and set(learned) == {"english"}
    assert replayed and set(replayed) == {"korean law"}  # older traffic: replayed (share 4.0)
    assert exported.requests == {"window": len(learned), "replay": len(replayed)}
    assert exported.tokens == {"window": 12 * len(learned), "replay": 12 * len(replayed)}
    judged = tmp_path / "data" / export.JUDGED_DIR  # its held-out requests: scored as learned
    assert list((judged / export.WINDOW_DIR).glob("*.ckpt"))
    assert not list((judged / export.REPLAY_DIR).glob("*.ckpt"))


@pytest.mark.parametrize("relearn", [True, False])
def test_a_segment_the_cycle_learns_is_learned_from_its_earlier_requests_too(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path, relearn: bool
) -> None:
    """Korean law arrives over two windows: the cycle the drift check sends to learn it
    trains on the first window's Korean-law requests as well (none the gate holds out),
    as a draft trained on that traffic alone would; English, which it keeps, stays
    replay. English docs, too thin in the window to judge (learned there, not found
    fallen), keep their earlier requests as replay. With ``cycle.relearn_older`` off,
    older requests are only replayed."""
    config = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"relearn_older": relearn})}
    )
    older = [_record(i, CENTERS[0], "english") for i in range(10)]
    older += [_record(100 + i, CENTERS[1], "korean law") for i in range(10)]
    docs = [_record(300 + i, CENTERS[0], "english docs") for i in range(10)]
    _write(lake_store, config, older + docs)
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    window = [_record(200 + i, CENTERS[1], "korean law") for i in range(10)]
    window += [_record(400 + i, CENTERS[0], "english docs") for i in range(3)]
    _write(lake_store, config, window)
    snapshot = cycle.snapshot_window(config, "c2")
    checked = _store_drift(
        lake_store,
        config,
        {"korean law": 1.0, "english": 3.0},
        drifted=["korean law"],
        fitting=["english"],
    )
    exported = export.export_training_data(config, snapshot, tmp_path / "data")

    def ids(part: str) -> dict[str, set[tuple[int, ...]]]:
        found: dict[str, set[tuple[int, ...]]] = {}
        for path in (tmp_path / "data" / part).glob("*.ckpt"):
            raw = torch.load(path, weights_only=True)
            found.setdefault(raw["segment"], set()).add(tuple(raw["input_ids"].tolist()))
        return found

    gate = export.held_out_traffic(config, snapshot).samples  # held out, or reserved
    judged = {tuple(s.input_ids.tolist()) for samples in gate.values() for s in samples}

    def trainable(records: list[CapturedRecord]) -> set[tuple[int, ...]]:  # the gate's rest
        return {tuple(r.input_ids.tolist()) for r in records} - judged

    learned, replayed = ids("window"), ids("replay")
    earlier = trainable(older[10:])
    assert earlier  # some of the first window's Korean law is not held out
    assert trainable(window[1:10]) <= learned["korean law"]  # the window's first is judged
    judged_older = {tuple(r.input_ids.tolist()) for r in older[10:]} - earlier
    assert not judged_older & (learned["korean law"] | replayed.get("korean law", set()))
    assert trainable(window[10:]) <= learned["english docs"]  # unjudged: learned here
    assert not trainable(docs) & learned["english docs"]  # not relearned: never found fallen
    assert trainable(docs) & replayed["english docs"]  # kept, with its replay budget
    if relearn:
        assert earlier <= learned["korean law"] and not replayed.get("korean law")
    else:  # replayed (kept) instead: the budget is four windows
        assert not earlier & learned["korean law"] and earlier <= replayed["korean law"]
    assert set(learned) == {"korean law", "english docs"} and "english" in replayed
    assert exported.requests["window"] == sum(len(v) for v in learned.values())
    if relearn:  # training without a champion's check relearns nothing: same every cycle
        unchecked = checked.model_copy(update={"champion_version": None})
        lake_store.put_bytes(
            drift_check.drift_key(config, "c2"), unchecked.model_dump_json().encode()
        )
        export.export_training_data(config, snapshot, tmp_path / "unchecked")
        assert len(list((tmp_path / "unchecked" / "window").glob("*.ckpt"))) == len(
            trainable(window[1:])
        )


def test_a_cycle_sent_to_learn_by_drift_takes_any_gain_over_its_champion(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    """The trainer asks a gain beyond the noise of its few held-out requests, except in a
    cycle whose champion's drift check named segments it no longer fits: there any
    higher figure replaces the parent (the gate still judges it)."""
    assert cycle._training_settings(config, "c2").warm_gain == "beyond_noise"  # no check saved
    _store_drift(lake_store, config, {"english": 1.2}, drifted=["english"])
    assert cycle._training_settings(config, "c2").warm_gain == "any"
    _store_drift(lake_store, config, {"english": 3.0}, drift=False)  # it still fits
    assert cycle._training_settings(config, "c2").warm_gain == "beyond_noise"
    _store_drift(lake_store, config, {"english": 3.0}, drifted=[])  # trains, found no fall
    assert cycle._training_settings(config, "c2").warm_gain == "beyond_noise"
    _store_drift(lake_store, config, {}, champion_version=None)  # none yet: it trains
    assert cycle._training_settings(config, "c2").warm_gain == "beyond_noise"
    forced = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"force_promote": True})}
    )
    assert cycle._training_settings(forced, "c2").export == "last"


def test_the_window_first_answered_request_is_held_out(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    """The window's first request is always judged, so a small window has recent traffic
    to judge on; one the target answered with no token (a law line it ends at once) has
    nothing to verify, so the first answered request is judged in its place."""
    config = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"held_out_percent": 1})}
    )
    unanswered = [
        dataclasses.replace(record, loss_mask=np.zeros_like(record.loss_mask))
        for record in (_record(i, CENTERS[1], "korean law") for i in range(2))
    ]
    answered = [_record(10 + i, CENTERS[1], "korean law") for i in range(6)]
    _write(lake_store, config, unanswered + answered)
    snapshot = cycle.snapshot_window(config, "c1")
    reader = state.sample_reader(config)
    held = [
        sample.request_id
        for judged, sample, _digest in export._window_split(config, snapshot, reader)
        if judged and not content_fraction(sample.input_ids) * 100 < 1
    ]
    assert held == [answered[0].request_id]

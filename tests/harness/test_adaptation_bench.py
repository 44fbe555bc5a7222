"""``tide bench adaptation`` on a workload it has never seen (generated here, tiny target)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.harness import adaptation_bench
from tide_lib.harness.adaptation_bench import (
    WorkloadError,
    fresh_requests,
    held_out_indices,
    load_workload,
    run_adaptation_bench,
)
from tide_lib.harness.params import AdaptationBenchParams
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.target_model import load_corpus, render_prompt


def test_malformed_workload_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a", "segment": "x"}\n{"prompt": "b"}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: needs a non-empty \"segment\""):
        load_workload(path)
    path.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_workload(path)
    path.write_text('{"prompt": "a", "segment": "x"}\n')  # one segment: a workload without shift
    assert load_workload(path) == [{"prompt": "a", "segment": "x"}]


def test_copies_of_a_prompt_are_all_held_out_or_all_served() -> None:
    chat = [{"prompt": f"q{i % 7}", "segment": "chat"} for i in range(70)]  # each prompt 10x
    law = [{"prompt": f"law {i}", "segment": "law"} for i in range(3)]
    requests = chat + law
    held = held_out_indices(requests, 20)
    held_prompts = {requests[i]["prompt"] for i in held}
    served_prompts = {item["prompt"] for i, item in enumerate(requests) if i not in set(held)}
    assert held_prompts and not held_prompts & served_prompts
    assert {requests[i]["segment"] for i in held} == {"chat", "law"}  # one per segment at least
    assert held == held_out_indices(list(requests), 20)  # the same on every run
    assert held_out_indices([{"prompt": "only", "segment": "one"}] * 5, 1) == []


def test_fresh_requests_are_the_corpus_requests_a_workload_never_sent(tmp_path: Path) -> None:
    workload = adaptation_bench.segments_workload(
        tmp_path / "w.jsonl", [("english", 5), ("korean", 3)]
    )
    requests = load_workload(workload)
    fresh = fresh_requests(
        [*requests, {"prompt": "x", "segment": "mine"}], ["english", "mine"], 4, 16
    )
    assert [item["segment"] for item in fresh] == ["english"] * 4  # "mine" has no corpus
    sent = {item["prompt"] for item in requests}
    assert not sent & {item["prompt"] for item in fresh}
    assert len({item["prompt"] for item in fresh}) == 4
    assert {item["max_new_tokens"] for item in fresh} == {48}  # as the workload asks
    asked = [{**item, "max_new_tokens": 9} for item in requests]
    assert {item["max_new_tokens"] for item in fresh_requests(asked, ["english"], 2, 16)} == {9}
    assert fresh_requests(requests, ["english"], 0, 16) == []


def test_a_ratio_of_drafts_carries_the_paired_noise_of_its_requests() -> None:
    before = AcceptanceCount.of([(40, 10), (30, 10), (20, 10)])  # 3.0 pooled
    same = adaptation_bench._paired_ratio(before, before)
    assert same == (1.0, 0.0)  # the same draft: no noise at all
    one_fell = adaptation_bench._paired_ratio(
        before, AcceptanceCount.of([(40, 10), (30, 10), (10, 10)])
    )  # 2.667
    assert one_fell[0] == pytest.approx(8 / 9) and one_fell[1] > 1 - one_fell[0]
    all_fell = adaptation_bench._paired_ratio(
        before, AcceptanceCount.of([(37, 10), (27, 10), (17, 10)])
    )  # each -0.3
    assert all_fell[0] == pytest.approx(0.9) and all_fell[1] == pytest.approx(0.0, abs=1e-9)
    # copies of a prompt are one piece of evidence: three copies of one give no estimate
    copies = ["q", "q", "q"]
    assert (
        adaptation_bench._paired_ratio(before, AcceptanceCount.of([(40, 10)] * 3), copies)[1]
        is None
    )
    assert adaptation_bench._paired_ratio(AcceptanceCount(), before) == (
        0.0,
        None,
    )  # nothing measured


@pytest.mark.slow
@pytest.mark.e2e
def test_adaptation_bench_on_a_generated_workload(
    stack: TideConfig, tiny_target: Path, tmp_path: Path
) -> None:
    corpus = load_corpus()
    rng = random.Random(5)
    english = rng.sample(corpus.domain("en_chat"), 14)
    korean = rng.sample(corpus.domain("ko_chat"), 24)
    workload = tmp_path / "unseen.jsonl"
    workload.write_text(
        "".join(
            json.dumps(
                {"prompt": render_prompt(doc.turns[-1]), "segment": segment, "max_new_tokens": 12}
            )
            + "\n"
            for segment, docs in (("english", english), ("korean", korean))
            for doc in docs
        )
    )
    out = tmp_path / "adaptation.json"
    # The tiny target's drafts often tie: train every cycle and promote, so that the adapted
    # path is exercised (the drift check and the selection have tests of their own).
    forced = stack.model_copy(
        update={
            "cycle": stack.cycle.model_copy(
                update={"force_promote": True, "skip_without_drift": False}
            )
        }
    )
    result = run_adaptation_bench(
        forced,
        workload,
        out,
        AdaptationBenchParams(
            cycle_tokens=120,
            max_new_tokens=12,
            labels=True,
            timing_passes=2,
            settle=2,
            fresh=3,
            oracle_seeds=2,
        ),
        target_dir=tiny_target,
        preset="tiny",
        train=TrainConfig(
            steps=8,
            batch_size=2,
            ttt_length=3,
            draft_vocab_size=512,
            learning_rate=3e-3,
            validation_fraction=0,
            warm_epochs=0,
        ),
    )
    written = json.loads(out.read_text())
    assert written["new_segment"] == "korean" and written == json.loads(json.dumps(result))
    lengths = written["accept_length"]
    assert {"static", "oracle", "oracle-seed0", "oracle-seed1"} <= set(lengths)
    # the oracle pools its seeds' runs: its figure lies between theirs, on every segment
    for segment, by_k in lengths["oracle"].items():
        for k, pooled in by_k.items():
            runs = [lengths[f"oracle-seed{i}"][segment][k] for i in (0, 1)]
            assert min(runs) - 1e-9 <= pooled <= max(runs) + 1e-9
    assert written["params"]["oracle_seeds"] == 2
    # the final draft over each seed's oracle: the pooled ratio lies within their range
    final = written["final_adapted"]
    for suffix in ("", "_fresh", "_unseen"):
        by_seed = written[f"al_ratio_adapted_oracle{suffix}_by_seed"]
        assert list(by_seed) == ["oracle-seed0", "oracle-seed1"]
        final_length = written[f"accept_length{suffix}"][final]["korean"]
        for k in ("k3", "k5"):
            ratios = []
            for seed, by_k in by_seed.items():
                oracle_length = written[f"accept_length{suffix}"][seed]["korean"][k]
                assert by_k[k] == pytest.approx(final_length[k] / oracle_length), (seed, k)
                ratios.append(by_k[k])
            low, high = written[f"al_ratio_adapted_oracle{suffix}_seed_range"][k]
            assert (low, high) == (min(ratios), max(ratios))
            assert low - 1e-9 <= written[f"al_ratio_adapted_oracle{suffix}"][k] <= high + 1e-9
    # one draft trained on both segments' windowed traffic, measured against the oracle
    assert "joint" in lengths and set(lengths["joint"]) == {"english", "korean"}
    joint = written["al_ratio_joint_oracle"]["k3"]
    assert joint == pytest.approx(
        lengths["joint"]["korean"]["k3"] / lengths["oracle"]["korean"]["k3"]
    )
    assert set(written["al_ratio_joint_oracle_unseen"]) == {"k3", "k5"}
    assert any(name.startswith("adapted-") for name in written["accept_length"])
    timed = written["adaptive_k"]["timed_requests_by_k"]  # every held-out prompt, twice
    assert sum(timed.values()) == 2 * written["requests"]["held_out_new_segment"]
    assert {len(rates) for rates in written["tokens_per_s_by_pass"].values()} == {2}
    assert sum(written["adaptive_k"]["settling"]["requests_by_k"].values()) == 2  # untimed
    by_pass = written["adapted_adaptive_k_vs_plain_by_pass"]
    assert len(by_pass) == 2 and all(ratio > 0 for ratio in by_pass)
    for figures in written["accept_length"].values():
        assert set(figures) == {"english", "korean"} and set(figures["korean"]) == {"k3", "k5"}
    assert set(written["al_ratio_adapted_static"]) == {"k3", "k5"}
    assert written["tokens_per_s_static"] > 0 and written["tokens_per_s_adapted"] > 0
    assert written["threshold_to_serving_s"] and min(written["threshold_to_serving_s"]) > 0
    assert written["tokens_per_s_plain"] > 0
    assert set(written["retention"]) == {"english"}  # every segment but the last
    assert written["retention"]["english"]["before_draft"] in written["accept_length"]
    assert set(written["retention"]["english"]["margin"]) == {"k3", "k5"}
    assert set(written["retention_served"]) == {"english"}  # what the drafts learned
    assert set(written["accept_length_served"]["static"]) == {"english"}
    # and on English chat turns the workload never sent (from the corpus)
    assert written["requests"]["fresh_measured"] == {"english": 3, "korean": 3}
    assert set(written["retention_fresh"]) == {"english"}  # older segments only
    for name in ("static", "oracle"):  # the new segment's ratios on its fresh requests too
        assert set(written[f"al_ratio_adapted_{name}_fresh"]) == {"k3", "k5"}
        assert set(written[f"al_ratio_adapted_{name}_fresh_margin"]) == {"k3", "k5"}
    assert written["accept_length_fresh"]["static"]["english"]["k3"] >= 1.0
    # every request no draft trained on, pooled: held-out and fresh alike, so each
    # draft's figure lies between its figures on the two
    assert set(written["retention_unseen"]) == {"english"}
    assert set(written["al_ratio_adapted_oracle_unseen_margin"]) == {"k3", "k5"}
    for draft, segments in written["accept_length_unseen"].items():
        for segment, by_k in segments.items():
            for k, pooled in by_k.items():
                parts = [written[f"accept_length{of}"][draft][segment][k] for of in ("", "_fresh")]
                assert min(parts) - 1e-9 <= pooled <= max(parts) + 1e-9, (draft, segment, k)
    assert all(m is None or m >= 0 for m in written["al_ratio_adapted_static_margin"].values())
    held = written["held_out_requests"]
    assert held["korean"] == written["requests"]["held_out_new_segment"]
    assert sum(held.values()) == written["requests"]["held_out"]
    for entry in written["cycle_log"]:  # each window ends at the request that crossed
        # cycle_tokens, counted as soon as it was flushed (not a second later, by timing)
        assert (
            entry["window_tokens"]
            >= 120
            > entry["window_tokens"] - entry["crossing_request_tokens"]
        ), entry
    outcomes = [entry["outcome"] for entry in written["cycle_log"]]
    assert outcomes and set(outcomes) <= {"promoted", "rejected", "no-drift", "parent-best"}
    assert written["cycles_trained"] == len(outcomes)  # the drift check was off
    assert written["params"]["static_steps"] == 4 * 8  # fitted: four cycles' steps

"""Warm starts that do not regress: vocabulary from the mix, distillation, best checkpoint.

Real SpecForge forward/backward on the tiny target. Training data are its
captured states of corpus conversations (the tiny target's own greedy answers are
too repetitive to learn from) in the layout the cycle exports: ``window/``
(Korean, the new traffic) and ``replay/`` (English, older traffic).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tide_lib.config import TrainConfig
from tide_lib.training.distill import distill_kl, teacher_columns
from tide_lib.training.draft import build_vocab_mapping, count_output_tokens, load_draft
from tide_lib.training.schedule import step_plan
from tide_lib.training.selection import (
    Evaluation,
    HeldOut,
    Selection,
    sample_group,
    sample_split,
    split_held_out,
)
from tide_lib.training.trainer import (
    Eagle3Objective,
    TrainResult,
    draw_counts,
    initial_draft,
    list_samples,
    load_sample,
    sample_index,
    train_draft,
)

logger = logging.getLogger(__name__)

BASE = TrainConfig(
    steps=40,
    batch_size=4,
    ttt_length=3,
    draft_vocab_size=256,
    learning_rate=3e-3,
    checkpoint_every=100,
    log_every=5,
    eval_every=10,
    k=4,
)


# -- pure functions ---------------------------------------------------------------------


def test_a_warm_start_is_scaled_to_the_window() -> None:
    config = BASE.model_copy(
        update={"warm_epochs": 4.0, "warm_min_steps": 10, "warm_max_steps": 200}
    )
    fresh = step_plan(config, 30, warm=False)
    assert (fresh.steps, fresh.batch_size, fresh.learning_rate) == (40, 4, 3e-3)
    warm = step_plan(config, 30, warm=True)
    assert warm.steps == math.ceil(4.0 * 30 / 4) == 30
    assert warm.batch_size == 4
    assert warm.learning_rate == pytest.approx(3e-3 * config.warm_lr_scale)
    assert warm.warmup_steps <= warm.steps // 10
    assert step_plan(config, 30, warm=True, world=2).steps == math.ceil(4.0 * 30 / 8)
    tiny = step_plan(config, 2, warm=True)  # batch never exceeds the window, steps clamped
    assert (tiny.batch_size, tiny.steps) == (2, 10)
    assert step_plan(config, 10_000, warm=True).steps == 200
    as_given = step_plan(config.model_copy(update={"warm_epochs": 0}), 30, warm=True)
    assert (as_given.steps, as_given.learning_rate) == (40, 3e-3)


def test_draw_counts_are_what_the_sampler_draws() -> None:
    for total, samples, seed in ((0, 5, 0), (7, 5, 1), (23, 7, 3), (40, 4, 0)):
        drawn = [0] * samples
        for index in range(total):
            drawn[sample_index(index, samples, seed)] += 1
        assert draw_counts(total, samples, seed) == drawn


def test_the_held_out_split_hashes_names_and_covers_every_segment(tmp_path: Path) -> None:
    for split in ("window", "replay"):
        (tmp_path / split).mkdir()
        for index in range(40):
            payload: dict[str, object] = {
                "input_ids": torch.tensor([index, len(split), 7]),
                "loss_mask": torch.tensor([0, 1, 1]),
            }
            if split == "window" and index < 3:
                payload["segment"] = "law"
            torch.save(payload, tmp_path / split / f"data_{index:06d}.ckpt")
    samples = list_samples(tmp_path)
    config = BASE.model_copy(update={"validation_fraction": 0.2, "validation_max_samples": 100})
    train, held = split_held_out(tmp_path, samples, config)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(samples)
    assert {path.parent.name for path in held} == {"window", "replay"}
    assert 4 <= len(held) <= 30
    law = [p for p in held if p.parent.name == "window" and int(p.stem[-6:]) < 3]
    assert len(law) == 2  # a 3-sample segment: 2 held out (the minimum), 1 trained on
    # copies of one request fall on the same side, and count once towards a quota
    for number in range(5):
        torch.save(
            {"input_ids": torch.tensor([1, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
            tmp_path / "window" / f"dup_{number}.ckpt",
        )
    samples = list_samples(tmp_path)
    train, held = split_held_out(tmp_path, samples, config)
    copies = [p for p in samples if p.name.startswith("dup_") or p.name == "data_000001.ckpt"]
    assert all(p in held for p in copies) or all(p in train for p in copies)
    assert split_held_out(tmp_path, list(reversed(samples)), config)[1] == sorted(
        held, key=samples.index, reverse=True
    )
    capped = config.model_copy(update={"validation_max_samples": 3})
    capped_held = split_held_out(tmp_path, samples, capped)[1]
    distinct = {tuple(torch.load(path)["input_ids"].tolist()) for path in capped_held}
    assert 2 <= len(distinct) <= 3  # the cap counts distinct requests (a copy is shared)
    off = config.model_copy(update={"validation_fraction": 0})
    assert split_held_out(tmp_path, samples, off) == (samples, [])
    # The window's held-out requests (the gate's) are always scored, never trained on.
    _judged_law_requests(tmp_path / "held_out" / "window", first_token=900, count=3)
    with_judged = list_samples(tmp_path)
    judged = [path for path in with_judged if "held_out" in path.parts]
    train_now, held_now = split_held_out(tmp_path, with_judged, config)
    assert len(judged) == 3 and set(judged) <= set(held_now) and not set(judged) & set(train_now)
    assert {sample_split(tmp_path, path) for path in judged} == {"window"}
    # three judged law requests meet the law segment's minimum: no more is split off for it
    # (a law sample still held out is a copy of a replay request chosen for replay's share)
    split_now = set(held_now) - set(judged)
    assert split_now <= set(held) and len(split_now) < len(held)
    assert split_held_out(tmp_path, with_judged, off) == (samples, [])  # off: none scored
    two = config.model_copy(update={"validation_max_samples": 2})
    assert len([p for p in split_held_out(tmp_path, with_judged, two)[1] if p in judged]) == 2
    # The older traffic's held-out requests the gate judges: scored in groups of their own
    # (never diluting a group the window learns), after the window's when the cap binds.
    _judged_law_requests(tmp_path / "held_out" / "older", first_token=950, count=4)
    with_older = list_samples(tmp_path)
    older = [path for path in with_older if "older" in path.parts]
    assert {sample_group(tmp_path, path) for path in older} == {"older/law"}
    assert {sample_split(tmp_path, path) for path in older} == {"replay"}
    scored = split_held_out(tmp_path, with_older, config)[1]
    assert set(older) <= set(scored)
    four = config.model_copy(update={"validation_max_samples": 4})
    capped_judged = [
        p for p in split_held_out(tmp_path, with_older, four)[1] if "held_out" in p.parts
    ]
    assert set(judged) <= set(capped_judged) and len(capped_judged) == 4  # the window's first


def _judged_law_requests(folder: Path, *, first_token: int, count: int, outputs: int = 1) -> None:
    """``count`` distinct two-token requests labelled ``law``, as the cycle exports them,
    whose last ``outputs`` tokens (0 or 1) the target answered."""
    folder.mkdir(parents=True)
    for index in range(count):
        torch.save(
            {
                "input_ids": torch.tensor([first_token + index, 7]),
                "loss_mask": torch.tensor([0, outputs]),
                "segment": "law",
            },
            folder / f"data_{index:06d}.ckpt",
        )


@pytest.mark.parametrize("older_judged", [4, 0])
def test_replay_a_segments_older_held_out_requests_already_score_is_all_trained_on(
    tmp_path: Path, older_judged: int
) -> None:
    """Replay is what a run keeps a segment by, training and distilling on it. Where the
    gate's older held-out requests of that segment (``older/law``) are scored anyway,
    they meet its minimum: none of its four replay samples is held out again (a Korean
    cycle trained on 4 of its 10 replay samples). Without them, two are, so that the
    forgetting check still scores the segment. Chat, learned from the window, keeps its
    own two held out beside its older requests: those judge no gain on the window."""
    _judged_law_requests(tmp_path / "replay", first_token=100, count=4)
    for index in range(10):
        (tmp_path / "window").mkdir(exist_ok=True)
        torch.save(_answered_sample("chat", 20 * index), tmp_path / "window" / f"w{index}.ckpt")
    if older_judged:
        folder = tmp_path / "held_out" / "older"
        _judged_law_requests(folder, first_token=900, count=older_judged)
        for index in range(older_judged):
            torch.save(_answered_sample("chat", 500 + 20 * index), folder / f"chat{index}.ckpt")
    config = BASE.model_copy(update={"validation_fraction": 0.15, "validation_max_samples": 32})
    train, held = split_held_out(tmp_path, list_samples(tmp_path), config)
    replay_held = [
        p for p in held if sample_split(tmp_path, p) == "replay" and "older" not in p.parts
    ]
    assert len(replay_held) == (0 if older_judged else 2)
    assert len([p for p in train if p.parent.name == "replay"]) == 4 - len(replay_held)
    assert len([p for p in held if "older" in p.parts]) == 2 * older_judged  # scored only
    assert len([p for p in held if p.parent.name == "window"]) >= 2  # chat's own


def test_requests_answered_with_no_token_are_never_the_evidence_of_a_group(
    tmp_path: Path,
) -> None:
    """Half the Korean law requests end at once (no output token). A group held out on
    those alone scores 0 whatever the draft learns: the run kept its parent and the
    drift check settled law at 1.02 (four-segment bench, 4846080)."""
    (tmp_path / "window").mkdir()
    for index in range(12):  # law to learn: even ones answered, odd ones not
        torch.save(
            {
                "input_ids": torch.tensor([index, 5, 7]),
                "loss_mask": torch.tensor([0, index % 2 == 0, index % 2 == 0]).long(),
                "segment": "law",
            },
            tmp_path / "window" / f"data_{index:06d}.ckpt",
        )
    _judged_law_requests(tmp_path / "held_out" / "window", first_token=900, count=2, outputs=0)
    samples = list_samples(tmp_path)
    config = BASE.model_copy(update={"validation_fraction": 0.2, "validation_max_samples": 100})
    train, held = split_held_out(tmp_path, samples, config)
    judged = [path for path in samples if "held_out" in path.parts]
    assert not set(judged) & set(train) and not set(judged) & set(held)  # no evidence
    scored = [torch.load(path)["loss_mask"] for path in held]
    assert len(scored) == 2 and all(int(mask.sum()) > 0 for mask in scored)


def test_the_distillation_gradient_is_student_minus_parent() -> None:
    torch.manual_seed(0)
    parent = [torch.randn(1, 6, 5) for _ in range(2)]
    student = [(p + 0.7 * torch.randn_like(p)).requires_grad_(True) for p in parent]
    mask = torch.tensor([[0, 1, 1, 1, 0, 1]])
    columns = torch.arange(5)
    kl = distill_kl(student, parent, mask, columns, decay=0.8)
    kl.backward()
    for step, (s, p) in enumerate(zip(student, parent, strict=True)):
        shifted = torch.cat((mask[:, step:], torch.zeros(1, step, dtype=mask.dtype)), dim=1)
        expected = (s.softmax(-1) - p.softmax(-1)) * shifted[..., None] / shifted.sum()
        assert s.grad is not None
        assert torch.allclose(s.grad, 0.8**step * expected, atol=1e-6)
    same = [p.clone().requires_grad_(True) for p in parent]
    zero = distill_kl(same, parent, mask, columns, decay=0.8)
    zero.backward()
    assert zero.item() == pytest.approx(0.0, abs=1e-6)
    assert all(float(s.grad.abs().max()) < 1e-6 for s in same if s.grad is not None)


def test_distillation_compares_drafts_on_the_tokens_both_can_draft() -> None:
    parent_targets, student_targets = [10, 11, 12, 13], [12, 10, 20, 11]
    columns = teacher_columns(
        torch.tensor(student_targets) - torch.arange(4),
        torch.tensor(parent_targets) - torch.arange(4),
    )
    assert columns.tolist() == [2, 0, -1, 1]
    parent = torch.tensor([[[2.0, 1.0, 0.5, 9.0]]])  # 13 is not in the student's vocabulary
    # The student exactly matching the parent renormalised over 12, 10, 11 (and 0 on 20).
    restricted = torch.tensor([0.5, 2.0, 1.0])
    student = torch.tensor([[[0.5, 2.0, -1e4, 1.0]]], requires_grad=True)
    kl = distill_kl([student], [parent], torch.ones(1, 1), columns, decay=1.0)
    assert kl.item() == pytest.approx(0.0, abs=1e-5)
    assert float(restricted.softmax(-1)[0]) == pytest.approx(
        student.detach().softmax(-1)[0, 0, 0].item()
    )


# -- real training on the tiny target -----------------------------------------------------


@pytest.fixture(scope="module")
def mix(captured: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cycle's training data: Korean ``window/`` and English ``replay/``."""
    root = tmp_path_factory.mktemp("mix")
    for split, source, count in (("window", "ko_train", 48), ("replay", "en_train", 16)):
        (root / split).mkdir()
        for path in sorted(captured[source].glob("*.ckpt"))[:count]:
            shutil.copy(path, root / split / path.name)
    return root


@pytest.fixture(scope="module")
def parent(
    tiny_target: Path, captured: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The champion: a draft trained on English traffic only."""
    config = BASE.model_copy(update={"steps": 60, "validation_fraction": 0})
    out = tmp_path_factory.mktemp("parent")
    return train_draft(captured["en_train"], tiny_target, out, config).draft_dir


@pytest.mark.slow
def test_the_vocabulary_follows_the_mix_and_keeps_shared_rows(
    tiny_target: Path, mix: Path, parent: Path
) -> None:
    samples = list_samples(mix)
    replay = [path.parent.name == "replay" for path in samples]
    champion = load_draft(parent, tiny_target)
    parent_targets = (torch.arange(champion.d2t.numel()) + champion.d2t).tolist()
    for replay_draws in (1, 5):  # replay drawn once vs five times per window draw
        draws = [replay_draws if is_replay else 1 for is_replay in replay]
        draft = initial_draft(samples, draws, tiny_target, BASE, champion)
        counts = count_output_tokens((load_sample(p) for p in samples), draws)
        d2t, t2d = build_vocab_mapping(counts, 256, champion.config.vocab_size, keep=parent_targets)
        assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
        new_targets = (torch.arange(d2t.numel()) + d2t).tolist()
        stayed = [t for t in new_targets if t in parent_targets]
        assert stayed and len(stayed) < len(new_targets)  # some tokens stay, some are new
        # places the mix leaves free keep the parent's tokens, never arbitrary low ids
        assert all(counts[t] > 0 or t in parent_targets for t in new_targets)
        assert set(parent_targets) <= set(new_targets) or all(counts[t] for t in new_targets)
        for token in stayed:
            row = draft.lm_head.weight[new_targets.index(token)]
            assert torch.equal(row, champion.lm_head.weight[parent_targets.index(token)])
        window_tokens = count_output_tokens(
            load_sample(p) for p, is_replay in zip(samples, replay, strict=True) if not is_replay
        )
        covered = sum(n for t, n in window_tokens.items() if t in set(new_targets))
        assert covered > sum(n for t, n in window_tokens.items() if t in set(parent_targets))
        replay_only = [
            t
            for t in count_output_tokens(
                load_sample(p) for p, r in zip(samples, replay, strict=True) if r
            )
            if t not in window_tokens
        ]
        once = count_output_tokens(load_sample(p) for p in samples)
        assert all(counts[t] == replay_draws * once[t] for t in replay_only)
    assert not torch.equal(champion.d2t, draft.d2t)


@pytest.mark.slow
def test_distillation_on_real_drafts_vanishes_at_the_parent_and_a_step_reduces_it(
    tiny_target: Path, mix: Path, parent: Path
) -> None:
    champion = load_draft(parent, tiny_target)
    student = copy.deepcopy(champion)
    objective = Eagle3Objective(student, tiny_target, BASE, teacher=champion)
    raw = load_sample(list_samples(mix / "replay")[0])

    output, kl = objective.forward(raw, "same", distill=True)
    assert kl is not None and output.loss.requires_grad
    kl.backward()
    assert kl.item() == pytest.approx(0.0, abs=1e-6)
    gradients = [p.grad for p in student.parameters() if p.grad is not None]
    assert gradients and all(float(g.abs().max()) < 1e-6 for g in gradients)

    torch.manual_seed(1)
    with torch.no_grad():
        student.lm_head.weight.add_(0.05 * torch.randn_like(student.lm_head.weight))
    student.zero_grad()
    _, before = objective.forward(raw, "perturbed", distill=True)
    assert before is not None and before.item() > 1e-3
    before.backward()
    grad = student.lm_head.weight.grad
    assert grad is not None and float(grad.abs().max()) > 0
    with torch.no_grad():
        student.lm_head.weight.sub_(0.5 * grad / grad.norm())
    _, after = objective.forward(raw, "stepped", distill=True)
    assert after is not None
    logger.info("KL to the parent: %.5f before a step, %.5f after", before.item(), after.item())
    assert after.item() < before.item()
    _, none = objective.forward(raw, "window sample", distill=False)
    assert none is None


class _Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.mark.slow
def test_a_run_that_makes_things_worse_exports_the_parent_bit_for_bit(
    tiny_target: Path, mix: Path, parent: Path, tmp_path: Path
) -> None:
    config = BASE.model_copy(
        update={
            "learning_rate": 5.0,
            "warm_lr_scale": 1.0,
            "warm_epochs": 0,
            "steps": 10,
            "warmup_steps": 0,
            "max_grad_norm": 1e4,
            "eval_every": 5,
        }
    )
    result = train_draft(mix, tiny_target, tmp_path, config, parent_dir=parent)
    logger.info("huge learning rate: %s", result.evaluations)
    assert result.best_step == 0 and result.best_is_parent and result.improved is False
    assert [e["step"] for e in result.evaluations] == [0, 5, 10]
    assert max(e["accept_length"] for e in result.evaluations[1:]) <= result.accept_length_before
    exported = load_file(result.draft_dir / "model.safetensors")
    original = load_file(parent / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    # export="last" (what cycle.force_promote trains with) keeps the last step regardless
    forced = config.model_copy(update={"export": "last"})
    last = train_draft(mix, tiny_target, tmp_path / "last", forced, parent_dir=parent)
    assert last.best_step == 10 and not last.best_is_parent and last.improved is None
    trained = load_file(last.draft_dir / "model.safetensors")
    assert any(not torch.equal(trained[key], original[key]) for key in original)


@pytest.mark.slow
def test_a_normal_warm_start_improves_and_reports_each_split(
    tiny_target: Path, mix: Path, parent: Path, tmp_path: Path
) -> None:
    sink = _Recorder()
    result = train_draft(mix, tiny_target, tmp_path, BASE, parent_dir=parent, metrics=sink)
    logger.info("warm start: best step %s, %s", result.best_step, result.evaluations)
    assert result.improved is True and not result.best_is_parent
    assert result.best_step is not None and result.best_step > 0
    assert result.accept_length_after is not None and result.accept_length_before is not None
    assert result.accept_length_after > result.accept_length_before
    assert result.validation_samples > 0
    assert result.learning_rate == pytest.approx(BASE.learning_rate * BASE.warm_lr_scale)
    first_step, first = sink.logged[0]
    assert first_step == 0
    assert {"heldout_accept_length_window", "heldout_accept_length_replay"} <= set(first)
    summary = sink.logged[-1][1]
    for split in ("window", "replay"):
        assert f"before_heldout_accept_length_{split}" in summary
        assert f"after_heldout_accept_length_{split}" in summary
    assert any("distill_kl" in metrics for _step, metrics in sink.logged)
    exported = load_draft(result.draft_dir, tiny_target)
    champion = load_draft(parent, tiny_target)
    assert not torch.equal(exported.d2t, champion.d2t)  # the vocabulary followed the mix


@pytest.mark.slow
def test_resume_keeps_the_best_so_far(
    tiny_target: Path, mix: Path, parent: Path, tmp_path: Path
) -> None:
    config = BASE.model_copy(
        update={"warm_epochs": 0, "steps": 16, "checkpoint_every": 4, "eval_every": 4}
    )

    def crash(step: int, _metrics: dict[str, float]) -> None:
        if step == 10:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train_draft(
            mix,
            tiny_target,
            tmp_path / "crashy",
            config,
            parent_dir=parent,
            on_step=crash,
        )
    checkpoint = torch.load(tmp_path / "crashy" / "checkpoints" / "step-00000008.pt")
    assert [e["step"] for e in checkpoint["selection"]["evaluations"]] == [0, 4, 8]
    resumed = train_draft(mix, tiny_target, tmp_path / "crashy", config, parent_dir=parent)
    straight = train_draft(mix, tiny_target, tmp_path / "straight", config, parent_dir=parent)
    assert resumed.resumed_from_step == 8
    assert [e["step"] for e in resumed.evaluations] == [0, 4, 8, 12, 16]
    assert resumed.evaluations == straight.evaluations
    assert resumed.best_step == straight.best_step
    a = load_file(resumed.draft_dir / "model.safetensors")
    b = load_file(straight.draft_dir / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-6), key


class _Scripted:
    """A held-out set whose scores are given: step -> (pooled, per group)."""

    def __init__(
        self,
        scores: dict[int, tuple[float, dict[str, float]]],
        output_tokens: dict[str, int] | None = None,
    ) -> None:
        self.scores = scores
        self.output_tokens = output_tokens or {"window": 500, "replay": 500}

    def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
        pooled, groups = self.scores[step]
        return Evaluation(step=step, accept_length=pooled, groups=groups)


def test_a_step_that_forgets_the_replayed_traffic_is_never_kept() -> None:
    """The trainer keeps what the gate would accept: a gain on the window that costs the
    older traffic more than the tolerance is not a better draft."""
    scripted = _Scripted(
        {
            0: (2.0, {"window": 1.5, "replay": 3.0}),
            10: (2.6, {"window": 2.6, "replay": 2.5}),  # best pooled, but forgot 0.5
            20: (2.2, {"window": 1.9, "replay": 2.95}),  # a smaller gain, nothing forgotten
        }
    )
    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(scripted, forgetting_tolerance=0.1)  # type: ignore[arg-type]
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)
    selection.evaluate(draft, 20)
    assert selection.best is not None and selection.best.step == 20
    lenient = Selection(scripted, forgetting_tolerance=1.0)  # type: ignore[arg-type]
    lenient.begin(draft, parent, None)
    lenient.evaluate(draft, 10)
    lenient.evaluate(draft, 20)
    assert lenient.best is not None and lenient.best.step == 10
    # a group scored on fewer held-out tokens than forgetting_min_tokens is not judged
    scripted.output_tokens = {"window": 500, "replay": 40}
    sparse = Selection(  # type: ignore[arg-type]
        scripted, forgetting_tolerance=0.1, forgetting_min_tokens=64
    )
    sparse.begin(draft, parent, None)
    sparse.evaluate(draft, 10)
    assert sparse.best is not None and sparse.best.step == 10


def test_forgetting_is_judged_paired_on_the_held_out_requests() -> None:
    """A group's drop counts only beyond the noise of its requests: two requests that move
    apart are not forgetting; the same pooled drop on every request is."""
    start = [(30, 10), (24, 10)]  # replay: 2.7
    apart = [(10, 10), (34, 10)]  # 2.2: one request collapsed, the other gained
    alike = [(25, 10), (19, 10)]  # 2.2: both lost 0.5

    def scored(replay: list[tuple[int, int]], window: int, pooled: float) -> Evaluation:
        return Evaluation(
            step=0,
            accept_length=pooled,
            groups={"replay": sum(e for e, _ in replay) / sum(v for _, v in replay)},
            # the window gained on every request: a gain beyond noise, whatever replay did
            requests={"replay": replay, "window": [(window, 10)] * 8},
        )

    class Paired:
        def __init__(self, later: list[tuple[int, int]]) -> None:
            self.later = later
            self.output_tokens = {"replay": 500}

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            evaluation = scored(start, 10, 2.0) if step == 0 else scored(self.later, 30, 2.5)
            return dataclasses.replace(evaluation, step=step)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for later, kept in ((apart, 10), (alike, 0)):
        selection = Selection(Paired(later), forgetting_tolerance=0.1)  # type: ignore[arg-type]
        selection.begin(draft, parent, None)
        selection.evaluate(draft, 10)
        assert selection.best is not None and selection.best.step == kept


def test_groups_too_thin_alone_are_judged_together() -> None:
    """Older traffic split into small segments: none is scored on forgetting_min_tokens,
    but together they are, and a step that lost all of them is not kept."""
    before = {"en-a": [(30, 10), (28, 10)], "en-b": [(32, 10), (29, 10)]}  # about 3.0
    after = {"en-a": [(20, 10), (19, 10)], "en-b": [(22, 10), (20, 10)]}  # about 2.0

    class Thin:
        def __init__(self, tokens: int, older: frozenset[str], window: int) -> None:
            self.output_tokens = {"en-a": tokens, "en-b": tokens, "window": 500}
            self.older_groups = older  # held out mostly from replay
            self.window = window  # tokens the parent emits per 10 verify steps on the window

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            groups = before if step == 0 else after
            gained = self.window + (20 if step else 0)  # a gain beyond noise
            requests = {**groups, "window": [(gained, 10)] * 8}
            lengths = {
                group: sum(e for e, _ in pairs) / sum(v for _, v in pairs)
                for group, pairs in requests.items()
            }
            pooled = [r for pairs in requests.values() for r in pairs]
            overall = sum(e for e, _ in pooled) / sum(v for _, v in pooled)
            return Evaluation(step, overall, lengths, requests)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    older = frozenset({"en-a", "en-b"})
    for tokens, groups, window, kept in (
        (40, older, 10, 0),  # 80 together: judged
        (20, older, 10, 10),  # 40 together: too thin even so
        # en-b is the window's traffic, which the parent serves no better than the window
        # as a whole (about 4.1): what the draft learns, not pooled
        (40, frozenset({"en-a"}), 45, 10),
        # the parent serves en-b (3.0) far better than the window as a whole (about 1.4):
        # traffic to keep, pooled
        (40, frozenset({"en-a"}), 10, 0),
    ):
        selection = Selection(  # type: ignore[arg-type]
            Thin(tokens, groups, window), forgetting_tolerance=0.1, forgetting_min_tokens=64
        )
        selection.begin(draft, parent, None)
        selection.evaluate(draft, 10)
        assert selection.best is not None and selection.best.step == kept


def test_a_loss_spread_over_older_groups_is_judged_on_all_their_requests() -> None:
    """One older group judged alone (its drop within the noise of two requests), another too
    thin to judge: pooled, their four requests show the loss (as the gate)."""
    before = {"en-a": [(30, 10), (30, 10)], "en-b": [(30, 10), (30, 10)]}
    after = {"en-a": [(20, 10), (29, 10)], "en-b": [(21, 10), (24, 10)]}

    class Spread:
        def __init__(self) -> None:
            self.output_tokens = {"en-a": 100, "en-b": 20, "window": 500}
            self.older_groups = frozenset({"en-a", "en-b"})

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            requests = {**(after if step else before), "window": [(30 if step else 10, 10)] * 8}
            lengths = {g: sum(e for e, _ in r) / sum(v for _, v in r) for g, r in requests.items()}
            return Evaluation(step, lengths["window"], lengths, requests)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(  # type: ignore[arg-type]
        Spread(), forgetting_tolerance=0.1, forgetting_min_tokens=64
    )
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)
    assert selection.best is not None and selection.best.step == 0


def test_held_out_groups_of_replayed_traffic_are_the_older_ones(tmp_path: Path) -> None:
    """What the trainer pools when thin: groups held out mostly from replay (older
    traffic), never one held out mostly from the window."""

    def sample(segment: str, seed: int, output: int) -> dict[str, object]:
        ids = torch.arange(seed, seed + 4 + output)
        return {
            "input_ids": ids,
            "loss_mask": torch.tensor([0] * 4 + [1] * output),
            "hidden_state": torch.zeros(len(ids), 2),
            "aux_hidden_state": torch.zeros(len(ids), 6),
            "segment": segment,
        }

    files = {
        tmp_path / "window" / "a.ckpt": sample("new", 0, 8),
        tmp_path / "window" / "b.ckpt": sample("mixed", 10, 3),
        tmp_path / "replay" / "c.ckpt": sample("mixed", 20, 8),
        tmp_path / "replay" / "d.ckpt": sample("old", 30, 5),
    }
    held = HeldOut(tmp_path, list(files), files.__getitem__, torch.nn.Identity(), 3)
    assert held.older_groups == {"mixed", "old"}  # mixed: 8 of its 11 tokens replayed
    assert held.output_tokens == {"new": 8, "mixed": 11, "old": 5}


def _answered_sample(segment: str, seed: int) -> dict[str, object]:
    """A labelled sample: 4 prompt tokens, 8 output tokens (distinct by ``seed``)."""
    ids = torch.arange(seed, seed + 12)
    return {
        "input_ids": ids,
        "loss_mask": torch.tensor([0] * 4 + [1] * 8),
        "hidden_state": torch.zeros(len(ids), 2),
        "aux_hidden_state": torch.zeros(len(ids), 6),
        "segment": segment,
    }


def _gate_held_out(
    tmp_path: Path,
    shares: dict[str, float] | None,
    min_tokens: int = 8,
    *,
    net_gain_tolerance: float | None = None,
    older_law: bool = False,
    margin: float | None = None,
) -> HeldOut:
    """A cycle's export: law learned, chat kept (its window requests under
    held_out/replay/), one older chat request (and, ``older_law``, one older law request),
    and how the gate figures the window (with ``net_gain_tolerance``: its rule 5 on, at
    that tolerance; with ``margin``: the gain its rule 4 asks for)."""
    sample = _answered_sample
    files = {
        tmp_path / "window" / "a.ckpt": sample("law", 0),  # validation: not the gate's
        tmp_path / "held_out" / "window" / "b.ckpt": sample("law", 20),
        tmp_path / "held_out" / "replay" / "c.ckpt": sample("chat", 40),
        tmp_path / "held_out" / "older" / "d.ckpt": sample("chat", 60),
    }
    if older_law:
        files[tmp_path / "held_out" / "older" / "e.ckpt"] = sample("law", 80)
    if shares is not None:
        figure: dict[str, Any] = {"shares": shares, "k": 3, "min_segment_tokens": min_tokens}
        if net_gain_tolerance is not None:
            figure |= {"net_gain": True, "tolerance": net_gain_tolerance}
        if margin is not None:
            figure["margin"] = margin
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "gate_figure.json").write_text(json.dumps(figure))
    return HeldOut(tmp_path, list(files), files.__getitem__, torch.nn.Identity(), 3)


def test_held_out_figures_the_gates_window_weighted_acceptance(tmp_path: Path) -> None:
    """The gate's rule 4 figure on the requests it judges: each window segment on its
    window requests (older ones added where those are too thin), by the window's shares."""
    shares = {"law": 0.25, "chat": 0.75}
    held = _gate_held_out(tmp_path / "a", shares)
    assert held.gate_window == {"law": [1], "chat": [0]}
    requests = {"law": [(8, 8), (16, 8)], "chat": [(24, 8)], "older/chat": [(8, 8)]}
    evaluation = Evaluation(10, 2.0, {}, requests)
    # law on its window request alone (2.0), not the validation one; chat 3.0
    assert held.window_weighted(evaluation) == pytest.approx(0.25 * 2 + 0.75 * 3)
    # the gate's min_segment_tokens 16: each window request is too thin alone, chat's is
    # pooled with its older request (2.0)
    thin = _gate_held_out(tmp_path / "b", shares, min_tokens=16)
    assert thin.window_weighted(evaluation) == pytest.approx(2.0)
    assert _gate_held_out(tmp_path / "c", None).window_weighted(evaluation) is None
    # figures without every request (another code's checkpoint) are not the gate's
    partial = Evaluation(10, 2.0, {}, {**requests, "law": [(8, 8)]})
    assert held.window_weighted(partial) is None


def _script_scores(held: HeldOut, at_step: dict[int, dict[str, list[tuple[int, int]]]]) -> None:
    """``held`` scores each step by the given per-request (emitted, verify steps) counts."""

    def score(draft: torch.nn.Module, step: int) -> Evaluation:
        requests = at_step[step]
        lengths = {g: sum(e for e, _ in r) / sum(v for _, v in r) for g, r in requests.items()}
        return Evaluation(step, 0.0, lengths, requests)

    held.score = score  # type: ignore[method-assign]


def test_a_step_below_its_parent_on_the_gates_window_weighted_figure_is_never_kept(
    tmp_path: Path,
) -> None:
    """The run learns law and keeps chat by distillation; the gate weighs both by their
    share of the window. A step that gained on law while chat slipped (within the
    forgetting tolerance) scores higher on what the run learns but lower on the gate's
    figure: registered, it would be a challenger below its parent on its own window
    (cycle 6 of a four-segment run, 2.895 against 3.110). Even when any gain counts."""
    held = _gate_held_out(tmp_path, {"law": 0.3, "chat": 0.7})
    assert held.older_groups == {"chat", "older/chat"}  # what the run keeps, not learns
    at_step = {
        0: {"law": [(12, 8), (12, 8)], "chat": [(28, 8)], "older/chat": [(28, 8)]},
        10: {"law": [(16, 8), (16, 8)], "chat": [(24, 8)], "older/chat": [(28, 8)]},
        20: {"law": [(20, 8), (20, 8)], "chat": [(27, 8)], "older/chat": [(28, 8)]},
    }
    _script_scores(held, at_step)
    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(held, forgetting_tolerance=0.6, gain_beyond_noise=False)
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)  # law 1.5 -> 2.0; chat 3.5 -> 3.0: 2.9 -> 2.7 weighted
    assert selection.best is not None and selection.best.step == 0
    # what it learned is not thrown away: a next run on the same parent starts from it
    kept_back = selection.continuation()
    assert kept_back is not None and kept_back.step == 10
    selection.evaluate(draft, 20)  # law 2.5, chat 3.375: 3.11 weighted
    assert selection.best.step == 20


@pytest.mark.parametrize("margin", [0.1, None])
def test_a_step_that_gains_less_than_the_gates_margin_is_never_kept(
    tmp_path: Path, margin: float | None
) -> None:
    """The gate promotes only a gain of ``gate.margin`` on its window-weighted figure
    (rule 4). Step 10 gains 0.075 on it: registered, the gate would reject it for no
    gain (a Korean-last cycle registered 2.500 against its parent's 2.500). Step 20
    gains 0.15: kept. Without a margin in the export (an older cycle's), step 10 is kept,
    as any gain counts (``warm_gain: any``)."""
    held = _gate_held_out(tmp_path, {"law": 0.3, "chat": 0.7}, margin=margin)
    chat = {"chat": [(28, 8)], "older/chat": [(28, 8)]}
    laws = ((0, 12), (10, 14), (20, 16))
    at_step = {step: {"law": [(12, 8), (law, 8)]} | chat for step, law in laws}
    _script_scores(held, at_step)
    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(held, forgetting_tolerance=0.6, gain_beyond_noise=False)
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)  # law 1.5 -> 1.75: 2.9 -> 2.975 weighted
    assert selection.best is not None
    assert selection.best.step == (0 if margin else 10)
    if margin:  # what it learned is not thrown away: a next run starts from it
        kept_back = selection.continuation()
        assert kept_back is not None and kept_back.step == 10
    selection.evaluate(draft, 20)  # law 2.0: 3.05 weighted, +0.15
    assert selection.best.step == 20


@pytest.mark.parametrize("net_gain", [True, False])
def test_a_step_whose_kept_traffic_loses_more_than_it_gains_is_never_kept(
    tmp_path: Path, net_gain: bool
) -> None:
    """The gate's rule 5 (``gate.net_gain``), met by the run: law is 90% of the window,
    chat 10%. Step 10 gains 0.35 on the gate's window-weighted figure while the chat it
    keeps (window and older requests, pooled) falls 1.0, within a loose forgetting
    tolerance: the gate would reject it. Step 20 loses 0.25 on chat for a 0.425 gain:
    kept. The older law request rises as the run learns law: it is law, not traffic to
    keep, and pooled with chat it would hide chat's loss. Without rule 5 in the export
    (an older cycle's, or ``net_gain`` off), step 10 is kept as before."""
    held = _gate_held_out(
        tmp_path,
        {"law": 0.9, "chat": 0.1},
        net_gain_tolerance=0.1 if net_gain else None,
        older_law=True,
    )
    chat = {0: [(28, 8)], 10: [(20, 8)], 20: [(26, 8)]}
    at_step = {
        step: {
            "law": [(12, 8), (12, 8)] if step == 0 else [(16, 8), (16, 8)],
            "older/law": [(12, 8)] if step == 0 else [(28, 8)],
            "chat": chat[step],
            "older/chat": chat[step],
        }
        for step in (0, 10, 20)
    }
    _script_scores(held, at_step)
    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(held, forgetting_tolerance=1.5, gain_beyond_noise=False)
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)  # weighted 1.7 -> 2.05; chat 3.5 -> 2.5
    assert selection.best is not None
    assert selection.best.step == (0 if net_gain else 10)
    selection.evaluate(draft, 20)  # weighted 1.7 -> 2.125; chat 3.5 -> 3.25
    assert selection.best.step == (20 if net_gain else 10)  # law alike: the earlier kept


def test_a_run_that_kept_its_parent_reports_what_its_best_step_learned() -> None:
    """Its continuation's gain per segment it learns (older traffic aside), else the least
    it held over its second half of steps: a segment it gained on is not settled as one
    no draft serves better."""
    evaluations = [
        {"step": 0, "accept_length": 2.0, "groups": {"law": 1.5, "chat": 3.5, "older/en": 3.0}},
        {"step": 10, "accept_length": 2.1, "groups": {"law": 2.0, "chat": 3.0, "older/en": 2.9}},
        {"step": 20, "accept_length": 2.0, "groups": {"law": 1.6, "chat": 3.5, "older/en": 3.0}},
    ]
    result = TrainResult(
        draft_dir=Path("d"),
        steps=20,
        resumed_from_step=None,
        final_loss=1.0,
        accuracy=[],
        trained_tokens=1,
        seconds=1.0,
        loss_backend="torch",
        best_step=0,
        best_is_parent=True,
        evaluations=evaluations,
        continuation_step=10,
    )
    assert result.learned_gains() == pytest.approx({"law": 0.5, "chat": -0.5})
    assert TrainResult.from_json(result.to_json()).learned_gains() == result.learned_gains()
    # No continuation (every step forgot older traffic): the least it held over the
    # second half of its steps (step 20 here), not one noisy evaluation.
    vetoed = dataclasses.replace(result, continuation_step=None)
    assert vetoed.learned_gains() == pytest.approx({"law": 0.1, "chat": 0.0})
    longer = [*evaluations, {"step": 30, "accept_length": 2.0, "groups": {"law": 2.5, "chat": 3.5}}]
    held = dataclasses.replace(vetoed, evaluations=longer).learned_gains()
    assert held == pytest.approx({"law": 0.1, "chat": 0.0})  # steps 20 and 30: law 1.6, 2.5
    assert dataclasses.replace(result, best_is_parent=False).learned_gains() == {}
    assert dataclasses.replace(vetoed, evaluations=evaluations[:1]).learned_gains() == {}
    # chat's window left the parent no room: what its older requests gained counts
    full = [
        {**e, "groups": {**e["groups"], "older/chat": 3.0 + e["step"] / 100}} for e in evaluations
    ]
    pooled = dataclasses.replace(result, evaluations=full, judged_with_older=["chat"])
    assert pooled.learned_gains() == pytest.approx({"law": 0.5, "chat": 0.1})
    assert TrainResult.from_json(pooled.to_json()).learned_gains() == pooled.learned_gains()


def test_a_gain_over_the_parent_within_its_noise_keeps_the_parent() -> None:
    """A warm start replaces the serving parent only on a gain its held-out requests can
    tell from noise (paired): else the cycle would register a draft the gate may well
    measure below its parent on the cycle's own held-out traffic."""
    parent_requests = [(20, 10), (24, 10), (22, 10), (26, 10)]  # 2.3
    noisy = [(30, 10), (14, 10), (31, 10), (18, 10)]  # 2.325: two up, two down
    uniform = [(24, 10), (28, 10), (26, 10), (30, 10)]  # 2.7: every request gained

    def scored(step: int, requests: list[tuple[int, int]]) -> Evaluation:
        pooled = sum(e for e, _ in requests) / sum(v for _, v in requests)
        return Evaluation(step, pooled, {"window": pooled}, {"window": requests})

    class Held:
        def __init__(self, later: list[tuple[int, int]]) -> None:
            self.later = later
            self.output_tokens = {"window": 500}

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            return scored(step, parent_requests if step == 0 else self.later)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for later, kept in ((noisy, 0), (uniform, 10)):
        selection = Selection(Held(later), forgetting_tolerance=0.1)  # type: ignore[arg-type]
        selection.begin(draft, parent, None)
        selection.evaluate(draft, 10)
        assert selection.best is not None and selection.best.step == kept
    fresh = Selection(Held(noisy), forgetting_tolerance=0.1)  # type: ignore[arg-type]
    fresh.begin(draft, None, None)  # a new draft: step 0 is no parent to protect
    fresh.evaluate(draft, 10)
    assert fresh.best is not None and fresh.best.step == 10
    # a parent the drift check found no longer fitting (training.warm_gain: any)
    unfit = Selection(Held(noisy), forgetting_tolerance=0.1, gain_beyond_noise=False)  # type: ignore[arg-type]
    unfit.begin(draft, parent, None)
    unfit.evaluate(draft, 10)
    assert unfit.best is not None and unfit.best.step == 10
    lower = [(20, 10), (24, 10), (22, 10), (16, 10)]  # 2.05
    worse = Selection(Held(lower), gain_beyond_noise=False)  # type: ignore[arg-type]
    worse.begin(draft, parent, None)
    worse.evaluate(draft, 10)
    assert worse.best is not None and worse.best.step == 0  # a lower figure never replaces it
    # every request gained, but four requests cannot say how much a gain varies
    few = Selection(Held(uniform), forgetting_tolerance=0.1, min_gain_requests=6)  # type: ignore[arg-type]
    few.begin(draft, parent, None)
    few.evaluate(draft, 10)
    assert few.best is not None and few.best.step == 0
    assert few.continuation() is not None  # what it learned is kept to continue from


def test_the_gain_over_the_parent_is_judged_on_the_traffic_the_run_learns() -> None:
    """Korean held out from the window gained on every request; English, held out from
    replay, moved up and down (no drop beyond tolerance). Pooled, the Korean gain is
    within the noise of the English requests; judged where the run learns, it is not."""
    before = {"korean": [(20, 10), (24, 10), (22, 10), (26, 10)], "english": [(20, 10)] * 8}
    after = {"korean": [(23, 10), (27, 10), (25, 10), (29, 10)]}
    after["english"] = [(12, 10), (28, 10)] * 4

    class Held:
        def __init__(self, older: frozenset[str]) -> None:
            self.output_tokens = {"korean": 500, "english": 500}
            self.older_groups = older

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            requests = before if step == 0 else after
            pairs = [r for group in requests.values() for r in group]
            pooled = sum(e for e, _ in pairs) / sum(v for _, v in pairs)
            lengths = {g: sum(e for e, _ in r) / sum(v for _, v in r) for g, r in requests.items()}
            return Evaluation(step, pooled, lengths, requests)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for older, kept in ((frozenset({"english"}), 10), (frozenset(), 0)):
        selection = Selection(Held(older), forgetting_tolerance=0.5)  # type: ignore[arg-type]
        selection.begin(draft, parent, None)
        selection.evaluate(draft, 10)
        assert selection.best is not None and selection.best.step == kept


def test_the_step_kept_is_the_best_on_the_window_not_pooled_with_older_traffic() -> None:
    """Law, held out from the window, rose at step 10 while older English (many held-out
    requests, from replay) slipped within the tolerance: pooled, step 10 is below the parent
    and step 20 (English up, law less) above both. The gate judges the window's gain, so
    the run keeps step 10."""
    steps = {
        0: {"law": [(12, 10)] * 4, "english": [(35, 10)] * 12},  # window 1.2, pooled 2.925
        10: {"law": [(16, 10)] * 4, "english": [(33, 10)] * 12},  # window 1.6, pooled 2.875
        20: {"law": [(14, 10)] * 4, "english": [(36, 10)] * 12},  # window 1.4, pooled 3.05
    }

    class Held:
        def __init__(self) -> None:
            self.output_tokens = {"law": 500, "english": 500}
            self.older_groups = frozenset({"english"})

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            requests = steps[step]
            pairs = [r for group in requests.values() for r in group]
            pooled = sum(e for e, _ in pairs) / sum(v for _, v in pairs)
            lengths = {g: sum(e for e, _ in r) / sum(v for _, v in r) for g, r in requests.items()}
            return Evaluation(step, pooled, lengths, requests)

    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(  # type: ignore[arg-type]
        Held(), forgetting_tolerance=0.3, gain_beyond_noise=False
    )
    selection.begin(draft, parent, None)
    selection.evaluate(draft, 10)
    selection.evaluate(draft, 20)
    assert selection.best is not None and selection.best.step == 10
    assert selection.best.accept_length == pytest.approx(1.6)
    tight = Selection(  # type: ignore[arg-type]
        Held(), forgetting_tolerance=0.1, gain_beyond_noise=False
    )
    tight.begin(draft, parent, None)
    tight.evaluate(draft, 10)  # English fell 0.2: forgotten, never kept
    tight.evaluate(draft, 20)
    assert tight.best is not None and tight.best.step == 20


def test_a_run_that_keeps_its_parent_leaves_its_best_step_to_continue_from() -> None:
    """Within the noise, the parent is exported, yet the best trained step that rose above
    it forgetting nothing is what a next run on this parent continues from; a run that
    exported a trained step, fell, or forgot leaves nothing."""
    english = [(30, 10)] * 8  # older traffic to keep: 3.0
    parent_requests = {"korean": [(20, 10), (24, 10), (22, 10), (26, 10)], "english": english}
    noisy = [(30, 10), (14, 10), (31, 10), (18, 10)]  # 2.325: within the noise
    noisier = [(31, 10), (15, 10), (31, 10), (18, 10)]  # 2.375: higher, still within it
    uniform = [(24, 10), (28, 10), (26, 10), (30, 10)]  # 2.7: every request gained
    lower = [(20, 10), (24, 10), (22, 10), (16, 10)]  # 2.05
    Steps = dict[int, dict[str, list[tuple[int, int]]]]

    class Held:
        def __init__(self, steps: Steps) -> None:
            self.steps = steps | {0: parent_requests}
            self.output_tokens = {"korean": 500, "english": 500}
            self.older_groups = frozenset({"english"})

        def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
            groups = self.steps[step]
            requests = [r for group in groups.values() for r in group]
            pooled = sum(e for e, _ in requests) / sum(v for _, v in requests)
            figures = {g: sum(e for e, _ in r) / sum(v for _, v in r) for g, r in groups.items()}
            return Evaluation(step, pooled, figures, groups)

    def run(korean: dict[int, list[tuple[int, int]]], kept_english: bool = True) -> Selection:
        lost = [(20, 10)] * 8  # English fell from 3.0 to 2.0 on every request
        steps = {
            s: {"korean": r, "english": english if kept_english else lost}
            for s, r in korean.items()
        }
        draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        selection = Selection(Held(steps), forgetting_tolerance=0.1)  # type: ignore[arg-type]
        selection.begin(draft, parent, None)
        for step in sorted(steps):
            with torch.no_grad():
                draft.weight.fill_(step)  # each step's weights tell it apart
            selection.evaluate(draft, step)
        return selection

    kept = run({10: noisy, 20: noisier, 30: noisy})
    assert kept.best is not None and kept.best.step == 0  # the parent is exported
    continuation = kept.continuation()
    assert continuation is not None and continuation.step == 20
    assert continuation.state is not None and float(continuation.state["weight"][0, 0]) == 20
    restored = Selection(Held({}))  # type: ignore[arg-type]
    restored.begin(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), kept.to_state())
    assert restored.continuation() is not None  # a resumed run keeps it
    assert run({10: uniform}).continuation() is None  # a trained step was exported
    assert run({10: lower}).continuation() is None  # nothing rose above the parent
    forgot = run({10: [(60, 10)] * 4}, kept_english=False)  # Korean soared, English lost
    assert forgot.evaluations[-1].accept_length > forgot.evaluations[0].accept_length
    assert forgot.continuation() is None


@pytest.mark.slow
def test_a_run_continues_from_the_start_it_is_given_and_still_judges_against_its_parent(
    tiny_target: Path, mix: Path, parent: Path, tmp_path: Path
) -> None:
    config = BASE.model_copy(
        update={"steps": 1, "learning_rate": 1e-9, "warm_epochs": 0, "export": "last"}
    )
    other = train_draft(
        mix / "window",
        tiny_target,
        tmp_path / "other",
        BASE.model_copy(update={"steps": 20, "validation_fraction": 0}),
    ).draft_dir
    plain = train_draft(mix, tiny_target, tmp_path / "plain", config, parent_dir=parent)
    continued = train_draft(
        mix, tiny_target, tmp_path / "continued", config, parent_dir=parent, start_dir=other
    )
    # step 0 is the parent either way: the draft the run must beat
    assert continued.evaluations[0] == plain.evaluations[0]
    fc = "fc.weight"
    exported = load_file(continued.draft_dir / "model.safetensors")
    start, champion = (
        load_file(other / "model.safetensors"),
        load_file(parent / "model.safetensors"),
    )
    assert torch.allclose(exported[fc], start[fc], atol=1e-6)
    assert not torch.allclose(exported[fc], champion[fc], atol=1e-3)


def _full_window_held_out(tmp_path: Path, min_tokens: int = 8) -> HeldOut:
    """A cycle's export learning Korean: a validation request and one the gate judges
    from the window (scored in 8 rounds), three older Korean requests the gate judges too;
    the gate asks 0.05 and ``min_tokens`` output tokens of a segment."""
    older = tmp_path / "held_out" / "older"
    files = {
        tmp_path / "window" / "a.ckpt": _answered_sample("ko", 0),
        tmp_path / "held_out" / "window" / "b.ckpt": _answered_sample("ko", 20),
        **{older / f"{seed}.ckpt": _answered_sample("ko", seed) for seed in (40, 60, 80)},
    }
    figure = {"shares": {"ko": 1.0}, "k": 3, "min_segment_tokens": min_tokens, "margin": 0.05}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "gate_figure.json").write_text(json.dumps(figure))
    return HeldOut(tmp_path, list(files), files.__getitem__, torch.nn.Identity(), 3)


@pytest.mark.parametrize(("window_at_ceiling", "min_tokens"), [(True, 8), (False, 8), (False, 9)])
def test_a_window_at_its_ceiling_is_judged_with_the_segments_older_requests(
    tmp_path: Path, window_at_ceiling: bool, min_tokens: int
) -> None:
    """Short answers the parent already drafts perfectly (8 output tokens at k=3: 29
    emitted in 8 rounds, 3.625) cannot show a gain: the run judges that segment on its
    older held-out requests too, in its score and on the gate's figure; so it does where
    the window's requests hold fewer output tokens than the gate's minimum (8 against
    9), as the gate does. Judged on its window alone, a Korean cycle whose six held-out
    requests had one 6-token answer (3.333 at every step, room to 4.0) kept its parent
    while the older Korean rose 2.89 -> 3.04. Where the window has room and tokens
    enough, its older requests stay what the run keeps (judged for forgetting), not
    what it is scored on."""
    held = _full_window_held_out(tmp_path, min_tokens)
    pooled = window_at_ceiling or min_tokens > 8
    # the validation request (first) has room; the gate's window request decides
    window = [(20, 8), (29, 8)] if window_at_ceiling else [(29, 8), (20, 8)]
    older = {0: [(16, 8)] * 3, 10: [(26, 8)] * 3}
    at_step = {step: {"ko": window, "older/ko": older[step]} for step in (0, 10)}
    _script_scores(held, at_step)
    draft, parent = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    selection = Selection(held, forgetting_tolerance=0.5)  # and a gain beyond the noise
    selection.begin(draft, parent, None)
    assert selection.judged_with_older == (["ko"] if pooled else [])
    selection.evaluate(draft, 10)
    assert selection.best is not None
    assert selection.best.step == (10 if pooled else 0)
    start, step = selection.evaluations
    parent_figure, step_figure = (
        held.window_weighted(start, start),
        held.window_weighted(step, start),
    )
    assert parent_figure is not None and step_figure is not None
    assert (step_figure > parent_figure) is pooled

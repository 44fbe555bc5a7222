"""``tide train``: an EAGLE3 draft trained on a window of captured hidden states.

TIDE uses SpecForge's classes in-process rather than its ``specforge train`` CLI:
the draft is SpecForge's ``LlamaForCausalLMEagle3``, the objective its
``OnlineEagle3Model`` (training-time test over ``ttt_length`` positions) driven by
its ``Eagle3TrainStrategy`` with the frozen target head re-projecting the
captured final states (``target_repr="hidden_state"``), and samples go through
its offline normaliser. What TIDE adds around them is what continual training
needs and the CLI does not offer: warm starts from the serving draft (keeping
or remapping its vocabulary), windows read from the lake, resumable
checkpoints, and metrics to an MLflow run.

Data: a directory in SpecForge's offline layout (one ``.ckpt`` per sample), as
written by :meth:`tide_lib.lake.LakeReader.export_specforge`, optionally split
into ``window/`` (new traffic) and ``replay/`` (older traffic) subdirectories. The
sample order is a pure function of the seed and the step, so a resumed run sees
exactly the samples an uninterrupted one would.

Warm starts fine-tune rather than retrain (:func:`~tide_lib.training.schedule.step_plan`:
steps, batch and learning rate scaled to the window), rebuild the draft
vocabulary from the training mix (``vocab_mapping="mix"``), add a distillation
term toward the parent on replay samples (:mod:`.distill`), and export the best
draft scored on a held-out split, the parent included (:mod:`.selection`).

Multi-GPU: run the same entry point under ``torchrun``; each process takes its
share of every step's samples and gradients are averaged by DDP. Device and
world size are configuration, nothing else changes.

A step whose loss or gradients are not finite (a bad record that slipped past the
lake's checks, an overflow) is skipped: no optimizer step, counted and logged, so
one bad sample cannot turn the draft's weights into NaN. Training fails, with a
clear error, only once more than ``max_skipped_step_fraction`` of the steps were
skipped: then the data, not one sample, is the problem.
"""

from __future__ import annotations

__all__ = [
    "MetricSink",
    "TrainResult",
    "draw_counts",
    "evaluate_draft",
    "list_samples",
    "load_sample",
    "train_draft",
]

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from tide_lib.config import TrainConfig
from tide_lib.training.distill import LogitTap, LossMaskTap, distill_kl, teacher_columns
from tide_lib.training.draft import (
    WEIGHTS_FILE,
    TargetHead,
    build_vocab_mapping,
    count_output_tokens,
    draft_tokens,
    export_draft,
    load_draft,
    new_draft,
)
from tide_lib.training.schedule import StepPlan, step_plan, warmup_cosine
from tide_lib.training.selection import (
    OLDER_PREFIX,
    REPLAY,
    BestDraft,
    HeldOut,
    Selection,
    sample_split,
    split_held_out,
)
from tide_lib.training.specforge_runtime import prepare_specforge

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
DRAFT_DIR = "draft"
CONTINUATION_DIR = "continuation"


class MetricSink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrainResult:
    draft_dir: Path
    steps: int
    resumed_from_step: int | None
    final_loss: float
    accuracy: list[float]  # top-1 accuracy per TTT position over the last logging interval
    trained_tokens: int
    seconds: float
    loss_backend: str
    skipped_steps: int = 0  # steps with a non-finite loss or gradient: no optimizer step
    # The step whose draft was exported: 0 is the starting draft (the parent of a warm
    # start), ``steps`` the last; without validation always ``steps``.
    best_step: int | None = None
    # The exported draft is the parent's weights, bit for bit: training found nothing
    # better on held-out traffic, so there is nothing new to register.
    best_is_parent: bool = False
    # The exported draft scores above the starting draft on held-out traffic; None
    # when nothing was held out (validation_fraction 0, or a single sample).
    improved: bool | None = None
    # Held-out acceptance, one entry per evaluation in step order (step 0 first):
    # {"step": int, "accept_length": float, "groups": {"window"|"replay"|segment: float}}
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    validation_samples: int = 0
    learning_rate: float = 0.0  # the base learning rate used (scaled for warm starts)
    batch_size: int = 0  # samples per step and process used
    # A run that kept its parent: its best trained step (above the parent within the
    # noise, forgetting nothing), for a next run on the same parent to start from.
    continuation_dir: Path | None = None
    continuation_step: int | None = None
    # Learned groups judged on their older held-out requests too: their window's are too
    # few for the gate, or leave the parent no room to gain (``Selection.judged_with_older``).
    judged_with_older: list[str] = dataclasses.field(default_factory=list)

    @property
    def accept_length_before(self) -> float | None:
        """Held-out acceptance length of the starting draft (the parent)."""
        return self.evaluations[0]["accept_length"] if self.evaluations else None

    @property
    def accept_length_after(self) -> float | None:
        """Held-out acceptance length of the exported draft."""
        for evaluation in self.evaluations:
            if evaluation["step"] == self.best_step:
                return float(evaluation["accept_length"])
        return None

    def learned_gains(self) -> dict[str, float]:
        """What a run that kept its parent learned: held-out gain over the parent per group
        of the traffic it learns (not ``older/``). With a continuation, the continuation's
        (what the next run starts from); without one, the smallest over the second half
        of its evaluated steps: a gain it held, not one noisy evaluation. A run whose
        every step forgot older traffic still learned: Korean 1.27 -> 2.02-2.42 in a run
        vetoed for forgetting Korean law, which reported nothing and was settled as
        learned in vain (held to the 1.345 its parent served there)."""
        by_step = {int(e["step"]): e["groups"] for e in self.evaluations}
        start = by_step.get(0)
        if not self.best_is_parent or start is None:
            return {}
        if self.continuation_step:
            learned = by_step.get(self.continuation_step)
            steps = [learned] if learned is not None else []
        else:
            trained = [groups for step, groups in sorted(by_step.items()) if step > 0]
            steps = trained[len(trained) // 2 :]
        return _gains(start, steps, self.judged_with_older)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> str:
        continuation = str(self.continuation_dir) if self.continuation_dir else None
        paths = {"draft_dir": str(self.draft_dir), "continuation_dir": continuation}
        return json.dumps({**dataclasses.asdict(self), **paths})

    @classmethod
    def from_json(cls, raw: str) -> TrainResult:
        payload = json.loads(raw)
        continuation = payload.get("continuation_dir")
        return cls(
            **{
                **payload,
                "draft_dir": Path(payload["draft_dir"]),
                "continuation_dir": Path(continuation) if continuation else None,
            }
        )


def _gains(
    start: dict[str, float], steps: list[dict[str, float]], judged_with_older: list[str]
) -> dict[str, float]:
    """Per group the parent (``start``) and every one of ``steps`` score, older traffic
    (``older/``) aside: the smallest of the steps' figures minus the parent's. A group
    ``judged_with_older`` (its window's requests too few for the gate, or leaving the
    parent no room to gain) gained what its older requests show where that is more."""
    if not steps:
        return {}

    def gain(group: str) -> float | None:
        if group not in start or not all(group in step for step in steps):
            return None
        return min(step[group] for step in steps) - start[group]

    gains = {
        group: value
        for group in steps[-1]
        if not group.startswith(OLDER_PREFIX) and (value := gain(group)) is not None
    }
    for group in set(judged_with_older) & set(gains):
        older = gain(OLDER_PREFIX + group)
        if older is not None:
            gains[group] = max(gains[group], older)
    return gains


def list_samples(data_dir: Path) -> list[Path]:
    paths = sorted(data_dir.rglob("*.ckpt"))
    if not paths:
        raise FileNotFoundError(
            f"no training samples (*.ckpt) under {data_dir}; export a lake window first "
            "(`tide train --lake-target SLUG` does it)"
        )
    return paths


def load_sample(path: Path) -> dict[str, torch.Tensor]:
    sample: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return sample


class TargetFeatures:
    """Recomputes a sample's target states from its token ids (the no-reuse baseline)."""

    def __init__(self, target_dir: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        from tide_lib.target_model.hidden import HiddenStateCapture  # noqa: PLC0415

        self.model = AutoModelForCausalLM.from_pretrained(target_dir).to(device).eval()
        self.capture = HiddenStateCapture(self.model)
        self.device = device

    @torch.no_grad()
    def __call__(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.capture.capturing():
            self.model.model(input_ids=raw["input_ids"].reshape(1, -1).to(self.device))
        final, aux = self.capture.take()
        return {**raw, "hidden_state": final[0], "aux_hidden_state": aux[0]}


class _Teacher:
    """The frozen parent draft running the same TTT unroll, for the distillation term."""

    def __init__(self, parent: Any, student: Any, head: TargetHead, config: TrainConfig) -> None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: PLC0415
        from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: PLC0415

        self.draft: Any = copy.deepcopy(parent).to(config.device).eval()
        self.draft.requires_grad_(False)
        model = OnlineEagle3Model(self.draft, length=config.ttt_length, attention_backend="sdpa")
        self.strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=config.ploss_decay)
        self.logits = LogitTap(self.draft.lm_head)
        self.columns = teacher_columns(student.d2t, self.draft.d2t)
        shared = int((self.columns >= 0).sum())
        logger.info(
            "distilling toward the parent on replay samples (%d draft tokens shared)", shared
        )


class Eagle3Objective:
    """SpecForge's EAGLE3 TTT objective around one draft, on one device.

    With a ``teacher`` (the parent), :meth:`forward` can also return the
    distillation term toward it on the same batch.
    """

    def __init__(
        self, draft: Any, target_dir: Path, config: TrainConfig, teacher: Any | None = None
    ) -> None:
        from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: PLC0415
        from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: PLC0415
        from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: PLC0415

        self.device = torch.device(config.device)
        self.max_len = config.max_len
        self.ploss_decay = config.ploss_decay
        self.normalize = normalize_offline_sample
        self.draft = draft.to(self.device)
        eagle3 = OnlineEagle3Model(self.draft, length=config.ttt_length, attention_backend="sdpa")
        self.logits = LogitTap(self.draft.lm_head)
        self.loss_mask = LossMaskTap(eagle3)
        self.model: torch.nn.Module = eagle3
        if torch.distributed.is_initialized():
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.head = TargetHead(target_dir).to(self.device)
        self.recompute = (
            TargetFeatures(target_dir, self.device) if config.features == "recompute" else None
        )
        self.strategy = Eagle3TrainStrategy(
            self.model, target_head=self.head, ploss_decay=config.ploss_decay
        )
        self.teacher = _Teacher(teacher, self.draft, self.head, config) if teacher else None
        self.bf16 = config.precision == "bf16" or (
            config.precision == "auto"
            and self.device.type == "cuda"
            and torch.cuda.is_bf16_supported()
        )

    def _batch(self, raw: dict[str, torch.Tensor], sample_id: str) -> Any:
        from specforge.runtime.contracts import TrainBatch  # noqa: PLC0415

        if self.recompute is not None:
            raw = self.recompute(raw)
        tensors = self.normalize(raw, max_len=self.max_len)
        dtype = next(self.draft.parameters()).dtype
        tensors["hidden_state"] = tensors["hidden_state"].to(dtype)
        tensors["target"] = tensors["target"].to(dtype)
        return TrainBatch(
            sample_ids=[sample_id],
            strategy="eagle3",
            tensors=tensors,
            metadata={"target_repr": "hidden_state"},
        )

    def forward(
        self, raw: dict[str, torch.Tensor], sample_id: str, *, distill: bool = False
    ) -> tuple[Any, torch.Tensor | None]:
        """SpecForge's step output, and KL(parent || draft) when ``distill`` (else None)."""
        batch = self._batch(raw, sample_id)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        if not (distill and self.teacher is not None):
            with autocast:
                return self.strategy.forward_loss(batch), None
        with torch.no_grad(), autocast, self.teacher.logits.recording() as parent_logits:
            self.teacher.strategy.forward_loss(batch)
        with autocast, self.logits.recording() as logits:
            output = self.strategy.forward_loss(batch)
        loss_mask = self.loss_mask.take()
        kl = distill_kl(logits, parent_logits, loss_mask, self.teacher.columns, self.ploss_decay)
        return output, kl


class _Accuracy:
    """Pooled top-1 accuracy per TTT position over several samples."""

    def __init__(self) -> None:
        self.corrects: list[float] = []
        self.denoms: list[float] = []

    def add(self, metrics: dict[str, Any]) -> None:
        corrects = [float(c) for c in metrics["acc_corrects"]]
        denoms = [float(d) for d in metrics["acc_denoms"]]
        if not self.corrects:
            self.corrects, self.denoms = [0.0] * len(corrects), [0.0] * len(denoms)
        self.corrects = [a + b for a, b in zip(self.corrects, corrects, strict=True)]
        self.denoms = [a + b for a, b in zip(self.denoms, denoms, strict=True)]

    def values(self) -> list[float]:
        return [c / max(d, 1e-6) for c, d in zip(self.corrects, self.denoms, strict=True)]


def sample_index(global_index: int, num_samples: int, seed: int) -> int:
    epoch, offset = divmod(global_index, num_samples)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return int(torch.randperm(num_samples, generator=generator)[offset])


def draw_counts(total_draws: int, num_samples: int, seed: int) -> list[int]:
    """How often the sampler draws each sample in ``total_draws`` draws (exactly)."""
    epochs, remainder = divmod(total_draws, num_samples)
    counts = [epochs] * num_samples
    if remainder:
        generator = torch.Generator().manual_seed(seed * 100_003 + epochs)
        for index in torch.randperm(num_samples, generator=generator)[:remainder].tolist():
            counts[index] += 1
    return counts


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _maybe_init_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(backend=backend)
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _head_digest(path: Path, size: int = 2**20) -> str:
    """A sample's identity, cheaply: the digest of its first MiB (ids and masks come first)."""
    with path.open("rb") as handle:
        return hashlib.sha256(handle.read(size)).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _run_fingerprint(
    data_dir: Path,
    samples: list[Path],
    config: TrainConfig,
    parent_dir: Path | None,
    batch_size: int,
    *,
    start_dir: Path | None = None,
) -> str:
    """What a checkpoint must match to be resumed: names, settings, parent (and start)
    weights; no paths.

    A retry on another host has other directories but the same samples (names,
    sizes, leading bytes) and parent, so it resumes; a different window or parent
    does not.
    """
    payload = {
        "samples": [
            (path.relative_to(data_dir).as_posix(), path.stat().st_size, _head_digest(path))
            for path in samples
        ],
        "config": config.model_dump(
            exclude={
                "checkpoint_every",
                "keep_checkpoints",
                "log_every",
                "device",
                "nproc_per_node",
                "batch_size",
            }
        ),
        # Processes x batch is what a step trains on; how it is split does not matter.
        "step_batch": batch_size * int(os.environ.get("WORLD_SIZE", "1")),
        "parent": _file_digest(parent_dir / WEIGHTS_FILE) if parent_dir else None,
        "start": _file_digest(start_dir / WEIGHTS_FILE) if start_dir else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def remap_vocabulary(draft: Any, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Adopt a new vocabulary mapping, keeping the lm_head rows of tokens both mappings share."""
    old_targets = draft_tokens(draft.d2t)
    new_targets = draft_tokens(d2t)
    old_row = {int(token): row for row, token in enumerate(old_targets.tolist())}
    weight = draft.lm_head.weight.detach().clone()
    fresh = torch.empty_like(weight)
    torch.nn.init.normal_(fresh, std=0.02)
    for row, token in enumerate(new_targets.tolist()):
        if token in old_row:
            fresh[row] = weight[old_row[token]]
    with torch.no_grad():
        draft.lm_head.weight.copy_(fresh)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)


def initial_draft(
    samples: list[Path],
    draws: list[int],
    target_dir: Path,
    config: TrainConfig,
    parent: Any | None,
) -> Any:
    """The draft training starts from: a new one, or a copy of the parent (vocabulary per
    ``vocab_mapping``). Token frequencies are the training mix's, each sample counted
    as often as training draws it."""

    def counts() -> Any:
        weights = draws if sum(draws) else None  # no steps: each sample once
        return count_output_tokens((load_sample(path) for path in samples), weights)

    if parent is None:
        logger.info(
            "training a new draft (draft vocabulary %d from the window)", config.draft_vocab_size
        )
        return new_draft(target_dir, config.draft_vocab_size, counts())
    draft = copy.deepcopy(parent)
    if config.vocab_mapping == "mix":
        d2t, t2d = build_vocab_mapping(
            counts(),
            draft.config.draft_vocab_size,
            draft.config.vocab_size,
            keep=draft_tokens(parent.d2t).tolist(),
        )
        kept = int((t2d & parent.t2d.cpu()).sum())
        remap_vocabulary(draft, d2t, t2d)
        logger.info(
            "warm start, draft vocabulary rebuilt from the training mix: %d of %d tokens kept",
            kept,
            int(t2d.sum()),
        )
    else:
        logger.info("warm start, keeping the parent's draft vocabulary")
    return draft


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint, tensors and plain values only: checkpoints come back from the lake
    bucket, which serving hosts can write, and must never run code when loaded."""
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _latest_checkpoint(directory: Path) -> Path | None:
    checkpoints = sorted(directory.glob("step-*.pt"))
    return checkpoints[-1] if checkpoints else None


def _save_checkpoint(directory: Path, state: dict[str, Any], keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{state['step']:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink()
    return path


def _resume(
    checkpoint_dir: Path,
    fingerprint: str,
    *,
    draft: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    steps: int,
    on_stale_checkpoint: Callable[[], None] | None,
) -> dict[str, Any] | None:
    """Load the latest checkpoint of this run, if any; returns it (its ``step``, best so
    far, evaluations and skipped steps come back with it).

    A checkpoint of another run (other data, parent or settings) is an error, or,
    with ``on_stale_checkpoint``, is dropped (the callback drops its copies too)
    and training starts over: a retry must not fail forever on an older attempt's debris.
    """
    latest = _latest_checkpoint(checkpoint_dir)
    if latest is None:
        return None
    state = load_checkpoint(latest)
    if state["fingerprint"] != fingerprint:
        if on_stale_checkpoint is None:
            raise RuntimeError(
                f"{latest} belongs to a different training run (other data, parent or settings); "
                f"use a new output directory or delete {checkpoint_dir}"
            )
        logger.warning("%s belongs to a different training run: starting over", latest.name)
        for stale in checkpoint_dir.glob("step-*.pt"):
            stale.unlink()
        on_stale_checkpoint()
        return None
    missing, unexpected = draft.load_state_dict(state["draft"], strict=False)
    if unexpected or [key for key in missing if "embed" not in key]:
        raise RuntimeError(
            f"{latest} does not fit the draft: missing {missing}, unexpected {unexpected}"
        )
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    logger.info("resuming from %s (step %d of %d)", latest, state["step"], steps)
    return state


class _NonFiniteSteps:
    """Counts skipped steps; raises once more than the allowed share of all steps was skipped."""

    def __init__(self, config: TrainConfig, steps: int, skipped: int = 0) -> None:
        self.allowed = config.max_skipped_step_fraction * steps
        self.skipped = skipped

    def check(self, loss: float, grad_norm: torch.Tensor, step: int) -> bool:
        """True if this step is finite everywhere (in every process); else count and log it."""
        bad = torch.tensor(
            0.0 if math.isfinite(loss) and bool(torch.isfinite(grad_norm)) else 1.0,
            device=grad_norm.device,
        )
        if torch.distributed.is_initialized():  # every process skips the same steps
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if not bool(bad):
            return True
        self.skipped += 1
        logger.warning(
            "step %d: loss %s, gradient norm %s are not finite: skipping the optimizer step "
            "(%d skipped, at most %.0f allowed)",
            step + 1,
            loss,
            float(grad_norm),
            self.skipped,
            self.allowed,
        )
        if self.skipped > self.allowed:
            raise RuntimeError(
                f"{self.skipped} of {step + 1} training steps had a non-finite loss or gradient, "
                f"more than train.max_skipped_step_fraction allows: the window holds bad "
                "records (NaN/inf states, out-of-vocabulary ids) or the learning rate is too "
                "high. Check the lake's debris counts in the export log, lower "
                "train.learning_rate, or raise train.max_skipped_step_fraction"
            )
        return False


def train_draft(
    data_dir: Path,
    target_dir: Path,
    out_dir: Path,
    config: TrainConfig,
    *,
    parent_dir: Path | None = None,
    start_dir: Path | None = None,
    metrics: MetricSink | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_checkpoint: Callable[[Path], None] | None = None,
    on_stale_checkpoint: Callable[[], None] | None = None,
) -> TrainResult:
    """Train (or resume training) a draft; exports the best one to ``out_dir/draft``.

    The best is the draft with the highest held-out acceptance among step 0 (the
    parent of a warm start) and every evaluation; the result says which. A warm start
    that keeps its parent also exports its best trained step to
    ``out_dir/continuation`` when one rose above the parent forgetting nothing
    (:meth:`Selection.continuation`); ``start_dir``, such a continuation of an earlier
    run on this parent, is where training starts (the parent stays step 0, the
    distillation teacher and the draft to beat).
    """
    backend = prepare_specforge(config.device, config.loss_backend)
    _maybe_init_distributed(config.device)
    rank, world = _rank_world()
    samples = list_samples(data_dir)
    train_samples, held_paths = split_held_out(data_dir, samples, config)
    if not train_samples:
        raise FileNotFoundError(
            f"no training samples under {data_dir}: all {len(samples)} are held-out requests "
            "(held_out/); the window is too small to train on, so wait for more traffic"
        )
    plan = step_plan(config, len(train_samples), warm=parent_dir is not None, world=world)
    start_dir = start_dir if parent_dir is not None else None  # continues a warm start only
    fingerprint = _run_fingerprint(
        data_dir, samples, config, parent_dir, plan.batch_size, start_dir=start_dir
    )
    torch.manual_seed(config.seed)

    parent = load_draft(parent_dir, target_dir) if parent_dir is not None else None
    start = load_draft(start_dir, target_dir) if start_dir is not None else parent
    if start_dir is not None:
        logger.info("continuing from %s, the last run's best step on this parent", start_dir)
    draws = draw_counts(plan.steps * plan.batch_size * world, len(train_samples), config.seed)
    draft = initial_draft(train_samples, draws, target_dir, config, start)
    splits = [sample_split(data_dir, path) for path in train_samples]
    distill = parent is not None and config.distill_weight > 0 and REPLAY in splits
    objective = Eagle3Objective(draft, target_dir, config, teacher=parent if distill else None)
    trainable, optimizer, scheduler = _optimizer(objective, plan)
    _log_plan(plan, world, splits, len(held_paths))
    checkpoint_dir = out_dir / CHECKPOINT_DIR
    resumed = _resume(
        checkpoint_dir,
        fingerprint,
        draft=draft,
        optimizer=optimizer,
        scheduler=scheduler,
        steps=plan.steps,
        on_stale_checkpoint=on_stale_checkpoint,
    )
    held_out = (  # rank 0 alone evaluates
        HeldOut(data_dir, held_paths, load_sample, objective.head, config.k)
        if held_paths and rank == 0
        else None
    )
    selection = _selection(held_out, config, metrics)
    selection.begin(draft, parent, resumed.get("selection") if resumed else None)
    run = _Run(
        config=config,
        plan=plan,
        objective=objective,
        samples=train_samples,
        splits=splits,
        rank=rank,
        world=world,
        trainable=trainable,
        optimizer=optimizer,
        scheduler=scheduler,
        selection=selection,
        nonfinite=_NonFiniteSteps(config, plan.steps, resumed["skipped_steps"] if resumed else 0),
    )
    started = time.perf_counter()

    def checkpoint(done: int) -> None:
        saved = run.save(checkpoint_dir, fingerprint, done)
        if on_checkpoint is not None:
            on_checkpoint(saved)

    last = run.loop(int(resumed["step"]) if resumed else 0, metrics, on_step, checkpoint)
    return _finish(
        run,
        (draft, parent),
        out_dir,
        metrics=metrics,
        last=last,
        seconds=time.perf_counter() - started,
        resumed_from_step=int(resumed["step"]) if resumed else None,
        loss_backend=backend,
        validation_samples=len(held_paths),
    )


def _finish(
    run: _Run,
    drafts: tuple[Any, Any | None],
    out_dir: Path,
    *,
    metrics: MetricSink | None,
    last: dict[str, float],
    seconds: float,
    resumed_from_step: int | None,
    loss_backend: str,
    validation_samples: int,
) -> TrainResult:
    """Export the selected draft (``drafts``: the trained one and its parent), and a
    continuation where one is kept, from rank 0; say what the run did."""
    draft, parent = drafts
    selection, plan = run.selection, run.plan
    if run.rank == 0 and metrics is not None and selection.best is not None:
        metrics.log_metrics(selection.summary_metrics(), step=plan.steps)
    best = selection.best if run.config.export == "best" else None
    draft_dir = out_dir / DRAFT_DIR
    continuation = selection.continuation() if best is not None else None
    if run.rank == 0:
        _export_best(draft, parent, best, plan.steps, draft_dir)
        if continuation is not None:
            _export_continuation(draft, continuation, out_dir / CONTINUATION_DIR)
    if run.world > 1:
        torch.distributed.barrier()
    return TrainResult(
        draft_dir=draft_dir,
        steps=plan.steps,
        resumed_from_step=resumed_from_step,
        final_loss=last.get("loss", math.nan),
        accuracy=[last[key] for key in sorted(k for k in last if k.startswith("acc_"))],
        trained_tokens=run.trained_tokens,
        seconds=seconds,
        loss_backend=loss_backend,
        skipped_steps=run.nonfinite.skipped,
        validation_samples=validation_samples,
        learning_rate=plan.learning_rate,
        batch_size=plan.batch_size,
        continuation_dir=out_dir / CONTINUATION_DIR if continuation is not None else None,
        continuation_step=continuation.step if continuation is not None else None,
        **_selected(selection, best, plan.steps, warm=parent is not None),
    )


def _log_plan(plan: StepPlan, world: int, splits: list[str], held_out: int) -> None:
    logger.info(
        "%d training samples (%d replay), %d held out; %d steps of %d x %d at lr %.2g",
        len(splits),
        splits.count(REPLAY),
        held_out,
        plan.steps,
        plan.batch_size,
        world,
        plan.learning_rate,
    )


def _selection(
    held_out: HeldOut | None, config: TrainConfig, metrics: MetricSink | None
) -> Selection:
    """What picks the exported draft: held-out acceptance (None: no validation split)."""
    return Selection(
        held_out,
        metrics.log_metrics if metrics is not None else None,
        forgetting_tolerance=config.forgetting_tolerance,
        forgetting_min_tokens=config.forgetting_min_tokens,
        gain_beyond_noise=config.warm_gain == "beyond_noise",
        min_gain_requests=config.min_gain_requests,
    )


def _optimizer(objective: Any, plan: StepPlan) -> tuple[list[torch.nn.Parameter], Any, Any]:
    """The trainable parameters, AdamW at the plan's rate, warmup then cosine decay."""
    trainable = [p for p in objective.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=plan.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, plan.warmup_steps, plan.steps)
    )
    return trainable, optimizer, scheduler


def _selected(
    selection: Selection, best: BestDraft | None, steps: int, *, warm: bool
) -> dict[str, Any]:
    """The result's fields about which draft was exported and what the evaluations said."""
    best_step = best.step if best is not None else steps
    return {
        "best_step": best_step,
        "best_is_parent": warm and best_step == 0,
        "improved": None if best is None else best_step > 0,
        "judged_with_older": selection.judged_with_older,
        "evaluations": [  # figures only: per-request counts stay in the checkpoint
            {k: v for k, v in dataclasses.asdict(entry).items() if k != "requests"}
            for entry in selection.evaluations
        ],
    }


def _export_best(
    draft: Any, parent: Any | None, best: BestDraft | None, steps: int, draft_dir: Path
) -> None:
    """Export the best draft: the parent itself, the last draft, or the best step's weights."""
    if parent is not None and (best.state is None if best is not None else steps == 0):
        if steps > 0:
            logger.warning("no step beat the parent on held-out traffic: exporting the parent")
        export_draft(parent, draft_dir)  # the parent's weights and vocabulary, untouched
    elif best is None or best.step == steps:
        export_draft(draft, draft_dir)
    else:
        logger.info("exporting step %d, the best on held-out traffic", best.step)
        draft.load_state_dict(best.state, strict=False)
        export_draft(draft, draft_dir)


def _export_continuation(draft: Any, continuation: BestDraft, directory: Path) -> None:
    logger.info(
        "no step beat the parent beyond the noise; step %d (%.3f) is kept to continue from",
        continuation.step,
        continuation.accept_length,
    )
    draft.load_state_dict(continuation.state, strict=False)
    export_draft(draft, directory)


@dataclasses.dataclass
class _Run:
    """One run's training steps: sampling, the objective (plus distillation), logging."""

    config: TrainConfig
    plan: StepPlan
    objective: Eagle3Objective
    samples: list[Path]
    splits: list[str]
    rank: int
    world: int
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    selection: Selection
    nonfinite: _NonFiniteSteps
    trained_tokens: int = 0

    def step(self, step: int) -> tuple[float, dict[str, float]]:
        """Forward and backward of one step's samples (this process's share)."""
        batch, world = self.plan.batch_size, self.world
        step_loss = distill_sum = 0.0
        distilled = 0
        accuracy = _Accuracy()
        for slot in range(self.rank, batch * world, world):
            index = sample_index(step * batch * world + slot, len(self.samples), self.config.seed)
            raw = load_sample(self.samples[index])
            replay = self.splits[index] == REPLAY
            output, kl = self.objective.forward(raw, self.samples[index].name, distill=replay)
            loss = output.loss if kl is None else output.loss + self.config.distill_weight * kl
            (loss / batch).backward()
            step_loss += float(output.loss.detach()) / batch
            if kl is not None:
                distill_sum, distilled = distill_sum + float(kl.detach()), distilled + 1
            self.trained_tokens += int(raw["input_ids"].numel())
            accuracy.add(output.metrics)
        extra = {f"acc_{i}": value for i, value in enumerate(accuracy.values())}
        if distilled:
            extra["distill_kl"] = distill_sum / distilled
        return step_loss, extra

    def save(self, directory: Path, fingerprint: str, done: int) -> Path:
        """A resumable checkpoint after ``done`` steps (the embeddings are the target's)."""
        state = self.objective.draft.state_dict()
        return _save_checkpoint(
            directory,
            {
                "step": done,
                "fingerprint": fingerprint,
                "draft": {k: v for k, v in state.items() if "embed" not in k},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "skipped_steps": self.nonfinite.skipped,
                "selection": self.selection.to_state(),
            },
            self.config.keep_checkpoints,
        )

    def loop(
        self,
        start_step: int,
        metrics: MetricSink | None,
        on_step: Callable[[int, dict[str, float]], None] | None,
        checkpoint: Callable[[int], None],
    ) -> dict[str, float]:
        """Steps ``start_step``..``plan.steps``; returns the last logged averages."""
        optimizer, scheduler, selection = self.optimizer, self.scheduler, self.selection
        config, steps = self.config, self.plan.steps
        window: dict[str, list[float]] = {}
        last: dict[str, float] = {"loss": float("nan")}
        progress = tqdm(
            range(start_step, steps),
            desc="train draft",
            unit="step",
            disable=self.rank != 0,
            initial=start_step,
            total=steps,
        )
        self.objective.model.train()
        for step in progress:
            optimizer.zero_grad(set_to_none=True)
            step_loss, extra = self.step(step)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, config.max_grad_norm)
            finite = self.nonfinite.check(step_loss, grad_norm, step)
            if finite:
                optimizer.step()
            else:
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step_metrics = {"loss": step_loss, "lr": float(scheduler.get_last_lr()[0])} | extra
            if finite:  # a skipped step's NaN would poison the logged averages
                for key, value in step_metrics.items():
                    window.setdefault(key, []).append(value)
            window.setdefault("skipped_steps", []).append(float(self.nonfinite.skipped))
            done = step + 1
            if self.rank == 0 and (done % config.log_every == 0 or done == steps):
                last = {key: sum(values) / len(values) for key, values in window.items()}
                window.clear()
                progress.set_postfix(
                    loss=f"{last.get('loss', math.nan):.3f}", acc0=f"{last.get('acc_0', 0):.3f}"
                )
                if metrics is not None:
                    metrics.log_metrics(last, step=done)
            if self.rank == 0 and (done % config.eval_every == 0 or done == steps):
                selection.evaluate(self.objective.draft, done)
            if self.rank == 0 and (done % config.checkpoint_every == 0 or done == steps):
                checkpoint(done)
            if on_step is not None:
                on_step(done, step_metrics)
        return last


@torch.no_grad()
def evaluate_draft(
    draft_dir: Path | None,
    target_dir: Path,
    data_dir: Path,
    config: TrainConfig,
    *,
    draft: torch.nn.Module | None = None,
) -> list[float]:
    """Top-1 accuracy of the draft per TTT position on held-out samples (SpecForge's metric).

    Position 0 is plain next-token accuracy given the target's true features.
    """
    prepare_specforge(config.device, config.loss_backend)
    if draft is None:
        if draft_dir is None:
            raise ValueError("give a draft directory or a draft model")
        draft = load_draft(draft_dir, target_dir)
    objective = Eagle3Objective(draft, target_dir, config)
    objective.model.eval()
    accuracy = _Accuracy()
    for path in list_samples(data_dir):
        output, _ = objective.forward(load_sample(path), path.name)
        accuracy.add(output.metrics)
    return accuracy.values()

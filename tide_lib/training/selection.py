"""Held-out acceptance while training, and keeping the best draft (the parent included).

A warm start trained on a small window can end worse than the draft it started
from, even on that window's traffic. So held-out requests are never trained on
and are scored with the offline acceptance replay (:mod:`tide_lib.evaluation.offline`,
the engine's own chain drafting) at step 0 and every ``eval_every`` steps: the
held-out requests the gate judges on (``held_out/``: the window's, and the older
traffic's in groups of their own, ``older/<segment>``), and a
share of the training samples (chosen by a hash of each request's tokens, so window
and replay alike, copies of a request together, and the same split on every retry).

The draft exported is the one with the best figure on the traffic it learns (the
groups not held out mostly from replay, near the gate's window-weighted gain) among
those that forget nothing: a step whose score on any group (the replayed older
traffic, a segment) fell more than ``forgetting_tolerance`` below the parent's is
never kept, whatever it gains on the window, since the gate would reject it; nor is
one that does not gain the gate's ``gate.margin`` over the parent on the gate's own
window-weighted figure (every window segment by its token share, as
``gate_figure.json`` says; :meth:`HeldOut.window_weighted`), nor one whose traffic to
keep, pooled, loses more than both the gate's tolerance and that figure's gain (the
gate's rule 5, ``gate.net_gain``). Step 0 is the parent, so a run that never beats
its parent exports the parent's weights and says so; and beating it means beyond the
noise of the held-out requests (paired, one-sided 95%): a gain within it registered
drafts that the gate then measured below their parent. Where the parent is known not
to fit the traffic learned (a cycle whose drift check found it fell, ``warm_gain:
any``), any higher figure replaces it: the few held-out requests of a window hid
real gains there (a new segment rising 1.56 -> 1.76 over ten evaluations, never kept).

Scores are pooled acceptance lengths (tokens per verify step) at ``TrainConfig.k``
of a round drafted from every output position (the evidence for comparing drafts,
see :func:`~tide_lib.evaluation.offline.acceptance_counts`), overall and per group:
a sample's segment label when its file carries one (``"segment"``), else its split,
``window`` or ``replay`` (the data directory's subdirectories; a directory without
them is all window).
"""

from __future__ import annotations

__all__ = [
    "JUDGED",
    "OLDER_PREFIX",
    "BestDraft",
    "Evaluation",
    "HeldOut",
    "Selection",
    "judged_by_the_gate",
    "sample_split",
    "split_held_out",
]

import copy
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tide_lib.config import TrainConfig
from tide_lib.evaluation.gate import weighted_figure
from tide_lib.evaluation.offline import (
    AcceptanceCount,
    ReplaySample,
    acceptance_counts,
    content_digest,
    content_fraction,
    no_room_to_gain,
    replay_sample,
    significant_drop,
)
from tide_lib.names import DataDirs

logger = logging.getLogger(__name__)
_EPSILON = 1e-9  # as the gate's: a drop at the threshold passes it, whatever rounding did

WINDOW, REPLAY = DataDirs.WINDOW, DataDirs.REPLAY
# The held-out requests the gate will judge the draft on (the window's, and under
# held_out/older/ the older traffic's), so the run scores them too and never trains on them.
JUDGED = DataDirs.HELD_OUT
OLDER_PREFIX = f"{DataDirs.OLDER}/"  # the group of an older held-out request: older/<segment>


_VALIDATION_SALT = b"tide-validation"  # independent of the cycle's held-out split
MIN_HELD_OUT_PER_GROUP = 2  # a group with fewer held-out samples could forget unseen


def sample_split(data_dir: Path, path: Path) -> str:
    """``replay`` for a sample under ``data_dir/replay/`` (or ``held_out/replay/``, or the
    older traffic's ``held_out/older/``), else ``window``."""
    parts = path.relative_to(data_dir).parts
    if parts[0] == JUDGED:
        parts = parts[1:]
    return REPLAY if parts and parts[0] in (REPLAY, DataDirs.OLDER) else WINDOW


def _older_evidence(data_dir: Path, path: Path) -> bool:
    """Is the sample an older held-out request the gate judges (``held_out/older/``)?"""
    parts = path.relative_to(data_dir).parts
    return len(parts) > 1 and parts[0] == JUDGED and parts[1] == DataDirs.OLDER


def judged_by_the_gate(data_dir: Path, path: Path) -> bool:
    """Is the sample one of the cycle's held-out requests (under ``data_dir/held_out/``)?"""
    return path.relative_to(data_dir).parts[0] == JUDGED


def sample_group(data_dir: Path, path: Path, raw: dict[str, Any] | None = None) -> str:
    """The group a sample is scored in: its segment label, else its split."""
    if raw is None:  # memory-mapped: only the label is read, not the states
        raw = torch.load(path, weights_only=True, mmap=True)
    segment = raw.get("segment")
    group = segment if isinstance(segment, str) else sample_split(data_dir, path)
    return OLDER_PREFIX + group if _older_evidence(data_dir, path) else group


def split_held_out(
    data_dir: Path, samples: list[Path], config: TrainConfig
) -> tuple[list[Path], list[Path]]:
    """``(train, held_out)``, by request content and stratified by group (segment, else split).

    The cycle's held-out requests (:data:`JUDGED`) are never trained on and, with
    validation on, scored first (up to ``validation_max_samples`` distinct ones): a
    draft the run keeps has beaten its parent on the requests the gate judges it on, not
    only on others. They count towards each group's share, minimum and the cap; a
    segment's older ones (``older/<segment>``) towards its own too, for as many of its
    replay requests (:func:`_older_credit`): they already score what its replay keeps,
    and every replay sample held out again is one the run neither trains nor distils on
    (a Korean cycle trained on 4 of its 10 replay samples, and its older English fell
    3.00 -> 2.40 in 20 steps).

    Only requests with output tokens are scored: one the target answered with no token
    (a document line it ends at once: half the Korean law requests) has nothing to
    verify, and a group held out on those alone scores 0 whatever the draft learns.

    The rest is split. Samples are ranked by a hash of their tokens
    (:func:`content_fraction`), so copies of one request fall together: held out, or
    trained on, never both. Each group holds out its distinct requests that hash below
    ``validation_fraction``, and at least :data:`MIN_HELD_OUT_PER_GROUP` of them (never
    its last): the forgetting check can only protect a segment it scores. The total is
    capped at ``validation_max_samples`` distinct requests, taken from the largest quotas
    first. None are split off when ``validation_fraction`` is 0 (then nothing is scored)
    or there is a single sample.
    """
    gate_held = [path for path in samples if judged_by_the_gate(data_dir, path)]
    samples = [path for path in samples if not judged_by_the_gate(data_dir, path)]
    if config.validation_fraction == 0:
        return samples, []
    judged, scored = _judged(data_dir, gate_held, config.validation_max_samples)
    if len(samples) < 2:
        return samples, judged
    keys = _content_keys(data_dir, samples)
    groups: dict[str, list[float]] = {}  # each group's distinct requests with outputs, by hash
    for fraction, group in sorted(
        {(key.fraction, key.group) for key in keys.values() if key.outputs}
    ):
        groups.setdefault(group, []).append(fraction)
    credit = _older_credit(data_dir, keys, scored)
    quota = {  # a group's judged requests count towards its share and its minimum
        name: max(
            0,
            min(
                len(requests) - 1,
                max(
                    MIN_HELD_OUT_PER_GROUP,
                    sum(fraction < config.validation_fraction for fraction in requests),
                )
                - scored.get(name, 0)
                - credit.get(name, 0),
            ),
        )
        for name, requests in groups.items()
    }
    if not any(quota.values()) and not judged:  # every group a single request: hold one
        if len({fraction for requests in groups.values() for fraction in requests}) < 2:
            return samples, judged  # one request to learn (copies aside): nothing if held out
        quota[next(iter(groups))] = 1
    while sum(quota.values()) > max(0, config.validation_max_samples - sum(scored.values())):
        largest = max(quota, key=lambda name: (quota[name], name))
        quota[largest] -= 1
    # by content alone: a copy labelled otherwise goes with the request it copies
    chosen = {f for name, requests in groups.items() for f in requests[: quota[name]]}
    held = {path for path, key in keys.items() if key.fraction in chosen}
    return [p for p in samples if p not in held], [p for p in samples if p in held] + judged


def _older_credit(data_dir: Path, keys: dict[Path, _Key], scored: dict[str, int]) -> dict[str, int]:
    """How many of each group's validation requests its older held-out ones the gate
    judges (``older/<group>``, counted in ``scored``) stand in for: at most its distinct
    replay requests, whose forgetting they score. A segment the run learns keeps its own
    window requests held out: its older ones judge no gain on the window."""
    replayed: dict[str, set[float]] = {}
    for path, key in keys.items():
        if key.outputs and sample_split(data_dir, path) == REPLAY:
            replayed.setdefault(key.group, set()).add(key.fraction)
    return {
        group: min(len(fractions), scored.get(OLDER_PREFIX + group, 0))
        for group, fractions in replayed.items()
    }


def _judged(data_dir: Path, paths: list[Path], cap: int) -> tuple[list[Path], dict[str, int]]:
    """The gate's held-out requests to score: at most ``cap`` distinct ones with output
    tokens, the window's first, then the older traffic's, each lowest by hash (the same
    on every retry; copies go together), and each group's count of them. Requests the
    target answered with no token (a document line it ends at once) are no evidence:
    never scored (nor trained on)."""
    keys = {path: key for path, key in _content_keys(data_dir, paths).items() if key.outputs}
    older = {key.fraction for path, key in keys.items() if _older_evidence(data_dir, path)}
    distinct = {key.fraction for key in keys.values()}
    kept = set(sorted(distinct, key=lambda f: (f in older, f))[:cap])
    counts: dict[str, int] = {}
    for _fraction, group in {(k.fraction, k.group) for k in keys.values() if k.fraction in kept}:
        counts[group] = counts.get(group, 0) + 1
    return [path for path in paths if path in keys and keys[path].fraction in kept], counts


class _Key(NamedTuple):
    """A sample's validation hash of its tokens, its group, and its output tokens."""

    fraction: float
    group: str
    outputs: int


def _content_keys(data_dir: Path, paths: list[Path]) -> dict[Path, _Key]:
    """Each sample's :class:`_Key`."""
    keys: dict[Path, _Key] = {}
    for path in paths:  # memory-mapped: the tokens and the label, not the states
        raw = torch.load(path, weights_only=True, mmap=True)
        fraction = content_fraction(raw["input_ids"], salt=_VALIDATION_SALT)
        outputs = int(raw["loss_mask"].sum())
        keys[path] = _Key(fraction, sample_group(data_dir, path, raw), outputs)
    return keys


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Held-out acceptance length of the draft at one step (0: the parent / initial draft)."""

    step: int
    accept_length: float
    groups: dict[str, float]
    # each held-out request's (emitted, verify steps), per group: drops are judged paired
    requests: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        return {"heldout_accept_length": self.accept_length} | {
            f"heldout_accept_length_{group}": value for group, value in self.groups.items()
        }


class HeldOut:
    """The held-out samples, in memory, grouped; scores a draft by offline replay."""

    def __init__(
        self,
        data_dir: Path,
        paths: list[Path],
        load: Callable[[Path], dict[str, Any]],
        lm_head: torch.nn.Module,
        k: int,
    ) -> None:
        self.groups: dict[str, list[ReplaySample]] = {}
        self.output_tokens: dict[str, int] = {}  # what each group's figure rests on
        # each group's positions of the window's requests the gate judges (held_out/,
        # not older/), and the window's token shares by segment: the gate's figure
        self.gate_window: dict[str, list[int]] = {}
        figure = _gate_figure(data_dir, k)
        self.window_shares, self.gate_min_tokens = figure.shares, figure.min_segment_tokens
        self.gate_margin, self.net_gain_tolerance = figure.margin, figure.net_gain_tolerance
        replay_tokens: dict[str, int] = {}
        seen: set[bytes] = set()
        for path in paths:
            raw = load(path)
            digest = content_digest(raw["input_ids"])
            if digest in seen:  # a copy of a request already held out: no new evidence
                continue
            seen.add(digest)
            group = sample_group(data_dir, path, raw)
            self.groups.setdefault(group, []).append(replay_sample(raw))
            if judged_by_the_gate(data_dir, path) and not _older_evidence(data_dir, path):
                self.gate_window.setdefault(group, []).append(len(self.groups[group]) - 1)
            tokens = int(raw["loss_mask"].sum())
            self.output_tokens[group] = self.output_tokens.get(group, 0) + tokens
            if sample_split(data_dir, path) == REPLAY:
                replay_tokens[group] = replay_tokens.get(group, 0) + tokens
        # groups held out mostly from replayed older traffic: what forgetting would lose
        self.older_groups = frozenset(
            group
            for group, tokens in replay_tokens.items()
            if 2 * tokens > self.output_tokens[group]
        )
        on_cpu = all(param.device.type == "cpu" for param in lm_head.parameters())
        self.lm_head = lm_head if on_cpu else copy.deepcopy(lm_head).to("cpu")
        self.k = k

    def __len__(self) -> int:
        return sum(len(samples) for samples in self.groups.values())

    def pools_older(self, reference: Evaluation, group: str) -> bool:
        """Is ``group``'s gain judged on its older held-out requests too, as the gate judges
        it (rule 4)? Where the window's requests of it that the gate judges hold fewer than
        the gate's ``min_segment_tokens`` output tokens, or leave ``reference`` (the
        parent) no room to gain (:meth:`leaves_no_room`). A few short answers are noise:
        in the demo, a Korean cycle's window held out six requests with one 6-token
        answer, 3.333 at every step against a ceiling of 4.0, and kept its parent while
        the older Korean rose 2.89 -> 3.04."""
        requests = reference.requests.get(group, [])
        if len(requests) != len(self.groups.get(group, ())):
            return False
        window = AcceptanceCount.of(requests[i] for i in self.gate_window.get(group, []))
        return self._too_few_tokens(window) or self.leaves_no_room(reference, group)

    def _too_few_tokens(self, window: AcceptanceCount) -> bool:
        """Does ``window`` (a group's requests the gate judges, as scored) hold fewer
        output tokens than the gate's ``min_segment_tokens``? Replayed from every output
        position, a request's verify steps are its output tokens (the loss mask's, which
        the gate counts)."""
        return window.verify_steps < max(self.gate_min_tokens, 1)

    def leaves_no_room(self, reference: Evaluation, group: str) -> bool:
        """Does ``reference`` (the parent) leave the window's requests of ``group`` that the
        gate judges (all of the group's where it judges none) less room below their
        ceiling than the gain the gate asks for (``gate.margin``)? Short answers served
        perfectly: no draft can show a gain on them. False for an evaluation that does
        not hold every request of the group."""
        requests = reference.requests.get(group)
        if not requests or len(requests) != len(self.groups.get(group, ())):
            return False
        window = self.gate_window.get(group)
        judged = [requests[i] for i in window] if window else requests
        return no_room_to_gain(judged, self.k, self.gate_margin)

    def window_weighted(
        self, evaluation: Evaluation, reference: Evaluation | None = None
    ) -> float | None:
        """The gate's window-weighted acceptance length (rule 4) on the held-out requests
        it judges that were scored (``validation_max_samples`` caps them, the window's
        first): each window segment's figure on its window requests, or, where those hold
        fewer than the gate's ``min_segment_tokens`` output tokens or leave ``reference``
        (the parent) no room to gain (:meth:`leaves_no_room`), on its older ones too,
        weighted by the window's token shares. None without shares or such requests, or
        when the evaluation does not hold every request (a checkpoint of another code)."""
        figures: dict[str, float] = {}
        for segment, share in self.window_shares.items():
            requests = evaluation.requests.get(segment, [])
            if len(requests) != len(self.groups.get(segment, ())):
                return None
            window = [requests[i] for i in self.gate_window.get(segment, [])]
            count = AcceptanceCount.of(window)
            if self._too_few_tokens(count) or (
                reference is not None and self.leaves_no_room(reference, segment)
            ):
                count = AcceptanceCount.of(
                    window + evaluation.requests.get(OLDER_PREFIX + segment, [])
                )
            if share > 0 and count.verify_steps:
                figures[segment] = count.accept_length
        return weighted_figure(figures, self.window_shares) if figures else None

    def score(self, draft: torch.nn.Module, step: int) -> Evaluation:
        """Replay every held-out sample with ``draft`` (on CPU; copied there if elsewhere)."""
        was_training = draft.training
        weight = draft.get_parameter("fc.weight")
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        replica = draft if on_cpu else copy.deepcopy(draft).to("cpu").float()
        counts = acceptance_counts(
            replica, self.lm_head, self.groups, [self.k], every_position=True
        )
        draft.train(was_training)  # the replay's runner puts the draft in eval mode
        by_group = {group: by_k[self.k] for group, by_k in counts.items()}
        verify = sum(count.verify_steps for count in by_group.values())
        emitted = sum(count.emitted for count in by_group.values())
        evaluation = Evaluation(
            step=step,
            accept_length=emitted / verify if verify else 0.0,
            groups={group: count.accept_length for group, count in by_group.items()},
            requests={group: list(count.per_request) for group, count in by_group.items()},
        )
        logger.info(
            "step %d: held-out acceptance length %.4f at k=%d %s",
            step,
            evaluation.accept_length,
            self.k,
            {group: round(value, 4) for group, value in evaluation.groups.items()},
        )
        return evaluation


@dataclasses.dataclass
class BestDraft:
    """The best draft scored so far; ``state`` None at step 0 means the starting draft."""

    step: int
    accept_length: float
    state: dict[str, torch.Tensor] | None = None

    def offer(self, evaluation: Evaluation, draft: torch.nn.Module, score: float) -> bool:
        """Keep ``draft`` if its ``score`` (:meth:`Selection._score` of ``evaluation``) is
        strictly better (ties keep the earlier, the parent)."""
        if score <= self.accept_length:
            return False
        self.step, self.accept_length = evaluation.step, score
        self.state = {
            key: value.detach().to("cpu", copy=True)
            for key, value in draft.state_dict().items()
            if "embed" not in key
        }
        return True

    def to_state(self) -> dict[str, Any]:
        return {"step": self.step, "accept_length": self.accept_length, "state": self.state}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BestDraft:
        return cls(int(state["step"]), float(state["accept_length"]), state["state"])


@dataclasses.dataclass(eq=False, repr=False)
class Selection:
    """The run's evaluations and best draft; survives a resume through the checkpoint.

    The rules come from ``training.*``: ``forgetting_tolerance``, ``forgetting_min_tokens``,
    ``min_gain_requests``, and ``gain_beyond_noise`` (``warm_gain``)."""

    held_out: HeldOut | None
    log: Callable[[dict[str, float], int], None] | None = None
    _: dataclasses.KW_ONLY
    forgetting_tolerance: float = float("inf")
    forgetting_min_tokens: int = 0
    gain_beyond_noise: bool = True
    min_gain_requests: int = 0
    evaluations: list[Evaluation] = dataclasses.field(default_factory=list, init=False)
    best: BestDraft | None = dataclasses.field(default=None, init=False)
    # step 0 is a parent that serves: replacing it must be no noise
    warm: bool = dataclasses.field(default=False, init=False)
    # a warm start's best trained step above the parent that forgot nothing (nor lost
    # more on traffic to keep than it gained), kept or not: where a next run on the
    # same parent can go on (see ``continuation``)
    candidate: BestDraft | None = dataclasses.field(default=None, init=False)

    def begin(
        self, draft: torch.nn.Module, parent: torch.nn.Module | None, saved: dict[str, Any] | None
    ) -> None:
        """Restore from a checkpoint's ``saved`` selection, or score the start as step 0."""
        if self.held_out is None:
            return
        self.warm = parent is not None
        if saved is not None:
            self.evaluations = [Evaluation(**entry) for entry in saved["evaluations"]]
            self.best = BestDraft.from_state(saved["best"])
            if saved.get("candidate") is not None:
                self.candidate = BestDraft.from_state(saved["candidate"])
            for kept in (self.best, self.candidate):  # scored as this code scores
                scored = next((e for e in self.evaluations if kept and e.step == kept.step), None)
                if kept is not None and scored is not None:
                    kept.accept_length = self._score(scored)
            return
        first = self.held_out.score(parent if parent is not None else draft, 0)
        self._record(first)
        if self.judged_with_older:
            logger.info(
                "the window's held-out requests of %s are too few for the gate "
                "(gate.min_segment_tokens) or leave the start no room to gain (less than "
                "gate.margin below their ceiling): their older ones are scored as learned too",
                self.judged_with_older,
            )
        if parent is not None:  # the parent's weights stay on disk: nothing to copy
            self.best = BestDraft(0, self._score(first))
            self.candidate = BestDraft(0, self._score(first))
        else:
            self.best = BestDraft(0, float("-inf"))
            self.best.offer(first, draft, self._score(first))

    def evaluate(self, draft: torch.nn.Module, step: int) -> None:
        if self.held_out is None or self.best is None:
            return
        evaluation = self.held_out.score(draft, step)
        self._record(evaluation)
        forgot = self._forgotten(evaluation)
        if forgot:
            logger.info("step %d is not kept: it forgot %s", step, forgot)
            return
        loses = self._loses_more_than_it_gains(evaluation)
        if loses is not None:  # nor continued from: the traffic it keeps paid for the gain
            logger.info(
                "step %d is not kept: traffic to keep loses %.4f, more than the gate's "
                "tolerance and the window-weighted gain %+.4f (gate.net_gain)",
                step,
                *loses,
            )
            return
        score = self._score(evaluation)
        if self.candidate is not None:  # what it learned, kept or not, is continued from
            self.candidate.offer(evaluation, draft, score)
        below = self._short_of_the_gates_margin(evaluation)
        if below is not None:
            logger.info(
                "step %d is not kept: window-weighted acceptance length %.4f, not above the "
                "parent's %.4f by the gate's margin %.4f on its held-out requests",
                step,
                *below,
            )
            return
        if self._within_noise_of_the_parent(evaluation):
            logger.info("step %d is not kept: above the parent within the noise", step)
        elif self.best.offer(evaluation, draft, score):
            logger.info("step %d is the best draft so far (%.4f on the window)", step, score)

    def _score(self, evaluation: Evaluation) -> float:
        """What the run keeps the best of: the figure on the traffic it learns
        (:func:`_window_figure`: the held-out requests of the groups not held out mostly
        from replay, pooled), near what the gate's window-weighted gain judges; older
        traffic is what :meth:`_forgotten` keeps. Pooled with it, the window's few held-out
        requests drown: a Korean-law cycle scored 3.6 overall at its parent, carried by
        older Korean chat, and no step's gain on law could show. A learned group whose
        window requests are too few for the gate, or leave the parent no room, pools its
        older ones (:meth:`_gain_groups`)."""
        return _window_figure(evaluation, self._gain_groups())

    @property
    def judged_with_older(self) -> list[str]:
        """Learned groups whose gain is judged on their older held-out requests too
        (:meth:`_gain_groups`)."""
        older = (g for g in self._gain_groups() if g.startswith(OLDER_PREFIX))
        return sorted(g.removeprefix(OLDER_PREFIX) for g in older)

    def _gain_groups(self) -> frozenset[str]:
        """The groups a gain is judged on: those not held out mostly from replay (the
        traffic the run learns), and the older held-out requests of each one the gate
        judges with them (:meth:`HeldOut.pools_older`: too few window requests, or
        none with room to gain), its ``older/<segment>``: the same traffic, sent earlier."""
        start = self.evaluations[0] if self.evaluations else None
        learned = self._learned_groups()
        with_older = getattr(self.held_out, "pools_older", None)
        if start is None or with_older is None:
            return learned
        full = {group for group in learned if with_older(start, group)}
        return learned | {OLDER_PREFIX + g for g in full if OLDER_PREFIX + g in start.requests}

    def _short_of_the_gates_margin(
        self, evaluation: Evaluation
    ) -> tuple[float, float, float] | None:
        """``(step, parent, margin)`` when a warm start's step does not gain the gate's
        ``gate.margin`` over its parent on the gate's window-weighted figure
        (:meth:`HeldOut.window_weighted`, rule 4), else None. The run keeps the best
        figure on the traffic it learns; the gate weighs every window segment by its
        share, the ones the cycle keeps by distillation too: a step that gained on Korean
        law while the window's other segments slipped within the tolerance was registered
        0.216 below its parent, under ``warm_gain: any`` or not; and a step level with its
        parent (2.500 against 2.500) was registered for the gate to reject it for no gain."""
        figures = self._as_gated(evaluation)
        margin = getattr(self.held_out, "gate_margin", 0.0)
        if figures is None or figures[1] - figures[0] >= margin - _EPSILON:
            return None
        parent, now = figures
        return now, parent, margin

    def _as_gated(self, evaluation: Evaluation) -> tuple[float, float] | None:
        """``(parent, step)`` of a warm start on the gate's window-weighted figure
        (:meth:`HeldOut.window_weighted`); None without one."""
        # a held-out set that does not know the gate's requests (a script) has no figure
        figure = getattr(self.held_out, "window_weighted", None)
        if not self.warm or figure is None or not self.evaluations:
            return None
        start = self.evaluations[0]
        parent, now = figure(start, start), figure(evaluation, start)
        return None if parent is None or now is None else (parent, now)

    def _loses_more_than_it_gains(self, evaluation: Evaluation) -> tuple[float, float] | None:
        """``(drop, gain)`` when a warm start's step loses more on the traffic to keep,
        pooled (:meth:`_keep_traffic`, point estimates), than both the gate's tolerance
        and its gain on the gate's window-weighted figure, else None: the gate's rule 5
        (``gate.net_gain``), which the run would otherwise meet only at the gate. A
        Korean cycle kept the step that gained most on Korean, +0.092 weighted, while
        the older traffic it kept fell 0.298; the gate rejected it, a cycle wasted on a
        challenger registered below its parent on the traffic it keeps."""
        held = self.held_out
        tolerance = getattr(held, "net_gain_tolerance", None)
        figures = self._as_gated(evaluation)
        if held is None or tolerance is None or figures is None:
            return None
        parent, now = figures
        start = self.evaluations[0]
        keep = self._keep_segments(evaluation)
        tokens = sum(held.output_tokens.get(group, 0) for group in keep)
        if not keep or tokens < held.gate_min_tokens:
            return None
        before = AcceptanceCount.of(r for g in keep for r in start.requests[g])
        after = AcceptanceCount.of(r for g in keep for r in evaluation.requests[g])
        drop, gain = before.accept_length - after.accept_length, now - parent
        return (drop, gain) if drop > max(tolerance, gain) + _EPSILON else None

    def _within_noise_of_the_parent(self, evaluation: Evaluation) -> bool:
        """Would ``evaluation`` replace the parent of a warm start on a gain that its
        held-out requests cannot tell from noise? The gain over the parent, paired on the
        same requests, must exceed its one-sided 95% margin of error (a draft registered
        on noise is as likely worse than its parent on the cycle's own held-out traffic).

        The gain is judged on the traffic the run learns (the groups not held out mostly
        from replay), where a warm start is meant to gain: pooled with the older traffic
        it is meant to keep (what :meth:`_forgotten` protects), a real gain drowns in
        their noise. Without such groups, on every held-out request.

        On fewer than ``min_gain_requests`` held-out requests no gain counts: the spread
        the noise is estimated from is itself noise.
        Off (``training.warm_gain: any``) when the parent is known not to fit the traffic
        learned: any higher figure replaces it, and the gate judges the draft."""
        if not self.gain_beyond_noise:
            return False
        if not self.warm or self.best is None or self.best.step != 0 or not self.evaluations:
            return False
        if self._score(evaluation) <= self.best.accept_length:
            return False  # not better at all: offer() refuses it anyway
        parent = self.evaluations[0]
        groups = sorted(self._gain_groups()) or sorted(parent.requests)
        paired = all(len(parent.requests[g]) == len(evaluation.requests.get(g, ())) for g in groups)
        if not groups or not paired:
            return False  # figures without their requests (a script, an old checkpoint)
        now = [r for group in groups for r in evaluation.requests[group]]
        start = [r for group in groups for r in parent.requests[group]]
        if len(now) < self.min_gain_requests:
            return True  # too few requests to estimate the noise by
        # the "drop" from this step to the parent is the step's gain: it must be significant
        return significant_drop(now, start, 0.0) is None

    def _forgotten(self, evaluation: Evaluation) -> dict[str, float]:
        """Groups that fell below the start (step 0) by more than ``forgetting_tolerance``,
        beyond the noise of their held-out requests (:func:`significant_drop`), among
        those measured on ``forgetting_min_tokens`` held-out output tokens; groups of
        traffic to keep are judged together too, pooled, once they reach it (as the gate)."""
        start = self.evaluations[0] if self.evaluations else None
        tokens = self.held_out.output_tokens if self.held_out is not None else {}
        forgot: dict[str, float] = {}
        thin: list[str] = []
        for group, value in evaluation.groups.items():
            if start is None or group not in start.groups:
                continue
            if tokens.get(group, 0) < self.forgetting_min_tokens:
                thin.append(group)
                continue
            if group in start.requests and group in evaluation.requests:
                drop = significant_drop(
                    start.requests[group], evaluation.requests[group], self.forgetting_tolerance
                )
            else:  # figures without their requests (a script, an old checkpoint)
                fell = start.groups[group] - value
                drop = fell if fell > self.forgetting_tolerance else None
            if drop is not None:
                forgot[group] = drop
                logger.debug(
                    "group %s: requests %s at step 0, %s now",
                    group,
                    start.requests.get(group),
                    evaluation.requests.get(group),
                )
        together = self._forgotten_together(evaluation, thin, tokens) if start else {}
        return forgot | together

    def _forgotten_together(
        self, evaluation: Evaluation, thin: list[str], tokens: dict[str, int]
    ) -> dict[str, float]:
        """Groups of traffic to keep pooled, whether or not each is judged alone too
        (``thin``: those on too few held-out tokens to be), when together they reach
        ``forgetting_min_tokens``: {"a+b": drop} if they fell beyond the tolerance.
        Traffic to keep, as the gate has it: older traffic (held out mostly from
        replay), and groups the parent serves better than the window's held-out traffic
        as a whole by more than the tolerance. Any other group of the window is what the
        draft learns: its gain would hide what the others lost. One group judged alone
        is not judged again."""
        start = self.evaluations[0]
        pooled = self._keep_traffic(evaluation)
        if not pooled or (len(pooled) == 1 and pooled[0] not in thin):
            return {}
        if sum(tokens.get(g, 0) for g in pooled) < self.forgetting_min_tokens:
            return {}
        before = [r for group in pooled for r in start.requests[group]]
        after = [r for group in pooled for r in evaluation.requests[group]]
        drop = significant_drop(before, after, self.forgetting_tolerance)
        return {} if drop is None else {"+".join(pooled): drop}

    def _keep_traffic(self, evaluation: Evaluation) -> list[str]:
        """The groups of traffic to keep, as the gate has it, that ``evaluation`` scored on
        the start's requests: older traffic (held out mostly from replay), and groups the
        parent serves better than the window's held-out traffic as a whole by more than
        the tolerance."""
        older, served_well = self._older_groups(), self._served_well()
        start = self.evaluations[0]
        return [
            group
            for group in evaluation.groups
            if group in start.groups
            and (group in older or start.groups[group] > served_well)
            and group in start.requests
            and group in evaluation.requests
            and len(start.requests[group]) == len(evaluation.requests[group])
        ]

    def _keep_segments(self, evaluation: Evaluation) -> list[str]:
        """:meth:`_keep_traffic` by segment, as the gate's rule 5 pools it: the older
        held-out requests of a segment the run learns (``older/<segment>``) are that
        segment, which the gate keeps only where the parent serves it well. Pooled with
        the older English, older Korean the run still learns would hide what English
        lost."""
        learned, served_well = self._learned_groups(), self._served_well()
        start = self.evaluations[0]
        return [
            group
            for group in self._keep_traffic(evaluation)
            if group.removeprefix(OLDER_PREFIX) not in learned or start.groups[group] > served_well
        ]

    def _served_well(self) -> float:
        """Above this figure the parent serves a group better than the window's held-out
        traffic as a whole (by more than the tolerance): traffic to keep, not to learn."""
        start = self.evaluations[0]
        return _window_figure(start, self._learned_groups()) + self.forgetting_tolerance

    def _learned_groups(self) -> frozenset[str]:
        """The groups of the start's evaluation not held out mostly from replay: the
        traffic the run learns."""
        start = self.evaluations[0] if self.evaluations else None
        older = self._older_groups()
        return frozenset(g for g in (start.requests if start else {}) if g not in older)

    def _older_groups(self) -> frozenset[str]:
        """Groups held out mostly from replayed older traffic (none for a held-out set
        that does not tell them apart)."""
        return getattr(self.held_out, "older_groups", frozenset())

    def _record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        if self.log is not None:
            self.log(evaluation.as_metrics(), evaluation.step)

    def to_state(self) -> dict[str, Any] | None:
        if self.best is None:
            return None
        return {
            "evaluations": [dataclasses.asdict(entry) for entry in self.evaluations],
            "best": self.best.to_state(),
            "candidate": self.candidate.to_state() if self.candidate is not None else None,
        }

    def continuation(self) -> BestDraft | None:
        """What a warm start that keeps its parent learned: its best trained step, above
        the parent on held-out traffic but within the noise, or short of the gate's margin
        over it on the gate's window-weighted figure, forgetting nothing nor losing more
        on the traffic to keep than it gained (:meth:`_loses_more_than_it_gains`). A next
        run on the same parent starts from it (the parent stays its step 0 and its
        teacher): gains too small for one window's held-out requests add up instead of
        being thrown away (the oracle of a new segment needs more steps than one cycle
        runs). None when the run exported a trained step, or none rose above the parent."""
        if self.best is None or self.best.state is not None or self.candidate is None:
            return None
        return self.candidate if self.candidate.state is not None else None

    def summary_metrics(self) -> dict[str, float]:
        """Held-out acceptance before (step 0) and after (the exported step), per group."""
        if not self.evaluations or self.best is None:
            return {}
        before = self.evaluations[0]
        after = next(e for e in self.evaluations if e.step == self.best.step)
        metrics = {"best_step": float(self.best.step)}
        for name, evaluation in (("before", before), ("after", after)):
            metrics |= {f"{name}_{key}": value for key, value in evaluation.as_metrics().items()}
        return metrics


class _GateFigure(NamedTuple):
    """How the gate judges the window (``gate_figure.json``)."""

    shares: dict[str, float]  # the window's token shares by segment
    min_segment_tokens: int
    margin: float  # the gain it asks for
    net_gain_tolerance: float | None  # rule 5's tolerance; None: rule 5 is off


_NO_GATE_FIGURE = _GateFigure({}, 0, 0.0, None)


def _gate_figure(data_dir: Path, k: int) -> _GateFigure:
    """How the gate figures the window, as the cycle exported it (none: not a cycle's
    data, no guard; no margin: an older cycle's, 0; no tolerance: no net-gain guard)."""
    path = data_dir / DataDirs.GATE_FIGURE
    if not path.is_file():
        logger.info("no %s: steps are not checked on the gate's figure", path.name)
        return _NO_GATE_FIGURE
    try:
        figure = json.loads(path.read_text())
        shares = {str(s): float(v) for s, v in figure["shares"].items()}
        min_tokens, gate_k = int(figure["min_segment_tokens"]), int(figure["k"])
        margin = float(figure.get("margin", 0.0))
        net_gain = figure.get("net_gain") is True and "tolerance" in figure
        tolerance = float(figure["tolerance"]) if net_gain else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logger.warning("%s is unreadable (%s): steps are not checked on it", path, error)
        return _NO_GATE_FIGURE
    if gate_k != k:
        logger.warning(
            "the gate judges at k=%d, the run scores at training.k=%d: steps are checked "
            "on the gate's figure at k=%d (set both alike)",
            gate_k,
            k,
            k,
        )
    return _GateFigure(shares, min_tokens, margin, tolerance)


def _window_figure(evaluation: Evaluation, groups: frozenset[str]) -> float:
    """The pooled acceptance length of the held-out requests of ``groups`` (the traffic
    the run learns); the whole figure when the groups are not told apart or carry no
    requests. (The gate's window-weighted figure weighs the segments it keeps too:
    :meth:`HeldOut.window_weighted`.)"""
    count = AcceptanceCount(keep_requests=False)
    window = [
        r for group, requests in evaluation.requests.items() if group in groups for r in requests
    ]
    for emitted, verify_steps in window:
        count.add(emitted, verify_steps)
    return count.accept_length if count.verify_steps else evaluation.accept_length

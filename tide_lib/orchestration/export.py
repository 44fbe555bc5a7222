"""What a cycle reads of the lake, and how it hands it to the trainer and the gate.

The window (the commits a snapshot froze) is read once per step through one loop
(:func:`_read_window`): each request is held out for the gate by a hash of its
content (``cycle.held_out_percent``), or learned, or kept (distilled), by the
segment the drift check named. Older traffic in the lookback is held out the same
way, with a reserved band for segments too thin to judge
(``cycle.held_out_reserve_percent``), and replayed by segment (:mod:`.replay`).

:func:`export_training_data` writes all of it in SpecForge's layout for the train
step; :func:`held_out_traffic` reads the very same held-out requests for the gate,
so the trainer scores its steps on what the gate will judge, and nothing judged is
ever trained on.
"""

from __future__ import annotations

__all__ = [
    "JUDGED_DIR",
    "REPLAY_DIR",
    "WINDOW_DIR",
    "HeldOutTraffic",
    "TrainingSet",
    "export_training_data",
    "held_out_samples",
    "held_out_traffic",
]

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from tide_lib.config import CycleConfig, TideConfig
from tide_lib.evaluation.gate import protected_segments
from tide_lib.evaluation.offline import content_digest, digest_fraction
from tide_lib.evaluation.segments import Segmenter, segment_as_grouped, segment_of
from tide_lib.lake import LakeReader
from tide_lib.lake.schema import CapturedRecord, specforge_file_name
from tide_lib.names import DataDirs
from tide_lib.orchestration.drift_check import saved_drift
from tide_lib.orchestration.handoff import Snapshot
from tide_lib.orchestration.replay import (
    ReplayCandidate,
    choose_replay,
    replay_quotas,
    token_shares,
)
from tide_lib.orchestration.state import (
    cycle_segmenter,
    log_debris,
    markers_of,
    read_state,
    sample_reader,
    state_key,
    stored_segmenter,
    write_state,
)

logger = logging.getLogger(__name__)


def _held_out(sample: CapturedRecord, percent: int, digest: bytes | None = None) -> bool:
    """Held out of training in every cycle: judges forgetting once the traffic is older.

    A hash of the request's tokens, not of its id: copies of one request (a prompt the
    fleet sees again and again) are all held out or all trained on, never both. A
    request the target answered with no token is never held out: it has nothing to
    verify, and as a request judged it would only narrow the margins of error.
    ``digest``: the sample's :func:`content_digest`, when the caller has it already.
    """
    return _in_band(sample, 0, percent, digest)


def _answered(sample: CapturedRecord) -> bool:
    """Did the target answer with at least one token (something to verify)?"""
    return bool(int(sample.loss_mask.sum()))


def _window_split(
    config: TideConfig, snapshot: Snapshot, reader: LakeReader
) -> Iterator[tuple[bool, CapturedRecord, bytes]]:
    """The window's requests in commit order, each with whether it is held out and its
    :func:`content_digest`.

    The one held-out rule (a hash of the request's tokens), so a request judged now is
    never trained on later as replay, and train and evaluate agree on any host
    even if a shard is quarantined in between. The window's first request with
    output tokens is held out too, so a small window still has recent traffic to judge
    on (one the target answered with no token has nothing to verify).
    """
    percent, first = config.cycle.held_out_percent, True
    for sample in reader.iter_records(markers_of(reader, snapshot.window)):
        answered, digest = _answered(sample), content_digest(sample.input_ids)
        yield (first and answered) or _held_out(sample, percent, digest), sample, digest
        first = first and not answered


def _reserved(sample: CapturedRecord, cycle: CycleConfig, digest: bytes | None = None) -> bool:
    """In the band of the content hash past the held-out one (``cycle.held_out_reserve_
    percent``): judged, when older, for a segment too thin to judge on held-out requests."""
    low = cycle.held_out_percent
    return _in_band(sample, low, low + cycle.held_out_reserve_percent, digest)


def _in_band(sample: CapturedRecord, low: float, high: float, digest: bytes | None = None) -> bool:
    """Answered, and its content hash (as a percentage) in ``[low, high)``: copies of a
    request fall in one band together. ``digest``: the sample's :func:`content_digest`,
    when the caller has it already (the tokens are hashed once per record read)."""
    if not _answered(sample):
        return False
    fraction = digest_fraction(digest or content_digest(sample.input_ids))
    return low <= fraction * 100 < high


@dataclasses.dataclass
class _WindowRead:
    """What the window holds, as the older held-out reading needs it: input tokens of
    every request and output tokens of the held-out ones judged, by segment; and the
    digest of every request (trained on or judged, never an older request to judge)."""

    tokens: dict[str, int]
    evidence: dict[str, int]
    digests: set[bytes]


@dataclasses.dataclass
class _Reserve:
    """A segment's reserved requests, in the order read, a copy once: kept only while
    they hold fewer output tokens than the gate's minimum (all a thin segment needs)."""

    samples: dict[bytes, CapturedRecord] = dataclasses.field(default_factory=dict)
    output_tokens: int = 0

    def keep(self, digest: bytes, sample: CapturedRecord, minimum: int | None) -> None:
        """Keep ``sample`` unless a copy is kept or the kept ones hold ``minimum`` output
        tokens (None: keep every one)."""
        full = minimum is not None and self.output_tokens >= minimum
        if not full and digest not in self.samples:
            self.samples[digest] = sample
            self.output_tokens += int(sample.loss_mask.sum())


def _read_window(
    config: TideConfig,
    snapshot: Snapshot,
    reader: LakeReader,
    segmenter: Segmenter,
    judged: set[bytes],
    *,
    judge: Callable[[str, CapturedRecord], None],
    learn: Callable[[str, CapturedRecord], None] | None = None,
) -> _WindowRead:
    """Read the window once, in commit order (:func:`_window_split`): hand ``judge`` each
    held-out request not judged before, by segment (``judged`` gains its digest: copies
    are judged once and never trained on), and ``learn`` every other request; return what
    the window holds. The export and the gate read the window through this one loop, so
    they agree on which requests are judged."""
    read = _WindowRead({}, {}, set())
    for held, sample, digest in _window_split(config, snapshot, reader):
        segment = segment_of(sample, segmenter)
        read.tokens[segment] = read.tokens.get(segment, 0) + int(sample.input_ids.numel())
        read.digests.add(digest)
        if digest in judged:
            continue
        if held:
            judge(segment, sample)
            judged.add(digest)
            read.evidence[segment] = read.evidence.get(segment, 0) + int(sample.loss_mask.sum())
        elif learn is not None:
            learn(segment, sample)
    return read


def _reserved_name(cycle_id: str) -> str:
    return f"cycles/{cycle_id}-reserved.json"


def _older_held_out(
    config: TideConfig,
    snapshot: Snapshot,
    reader: LakeReader,
    seen: set[bytes],
    *,
    segmenter: Segmenter,
    window: _WindowRead,
    judge: Callable[[str, CapturedRecord], None],
    reserved: set[bytes] | None = None,
) -> tuple[dict[str, int], set[bytes]]:
    """Hand ``judge`` the older requests the gate judges, read from the snapshot's older
    commits in order: held out (:func:`_held_out`) and not ``seen`` before (whose digests
    this adds to). Returns the input tokens of every older request read, by segment (the
    older shares), and the digests of the reserved requests judged.

    Once ``cycle.held_out_older_tokens`` tokens are judged, only requests of segments
    judged on fewer than ``gate.min_segment_tokens`` output tokens are (counting the
    window's held-out ones), up to twice the budget: a segment of short requests beside
    long ones (English chat beside documents and law texts) is read on until the gate can
    protect it alone. A budget in tokens fills with long requests: the short ones beside
    them would be too thin to protect however much of the older traffic they are.

    A segment the gate protects that is still that thin is judged on its reserved
    requests too (:func:`_reserved`; none of the window's), the thinnest segment first,
    until it has the minimum; the cycle then neither replays nor learns them again. The
    export decides which (``reserved`` None) and keeps the list in the cycle's state; the
    gate judges the ones listed (``reserved``), so that a shard lost in between can only
    leave a request unjudged, never judge one the cycle trained on.
    """
    judged_tokens, budget = 0, config.cycle.held_out_older_tokens
    minimum = config.gate.min_segment_tokens
    evidence = dict(window.evidence)  # judged output tokens per segment
    older_tokens: dict[str, int] = {}
    reserve: dict[str, _Reserve] = {}

    def take(name: str, sample: CapturedRecord) -> None:
        nonlocal judged_tokens
        judge(name, sample)
        judged_tokens += int(sample.input_ids.numel())
        evidence[name] = evidence.get(name, 0) + int(sample.loss_mask.sum())

    def wanted(name: str) -> bool:
        if judged_tokens < budget:
            return True
        return evidence.get(name, 0) < minimum and judged_tokens < 2 * budget

    for sample in reader.iter_records(markers_of(reader, snapshot.held_out_older)):
        name = segment_of(sample, segmenter)
        older_tokens[name] = older_tokens.get(name, 0) + int(sample.input_ids.numel())
        digest = content_digest(sample.input_ids)
        if _held_out(sample, config.cycle.held_out_percent, digest) and wanted(name):
            if digest not in seen:
                take(name, sample)
            seen.add(digest)
        elif _reserved(sample, config.cycle, digest) and digest not in window.digests:
            if reserved is None:  # the export: enough to bring a thin segment to the minimum
                reserve.setdefault(name, _Reserve()).keep(digest, sample, minimum)
            elif digest in reserved:  # the gate: the ones the export listed
                reserve.setdefault(name, _Reserve()).keep(digest, sample, None)
    chosen: set[bytes] = set()
    if reserved is None:
        names = _thinnest_first(config, reserve, evidence, window.tokens, older_tokens)
    else:
        names = list(reserve)
    for name in names:
        for digest, sample in reserve[name].samples.items():
            full = evidence.get(name, 0) >= minimum or judged_tokens >= 2 * budget
            if reserved is None and full:
                break
            if digest not in seen:
                take(name, sample)
                seen.add(digest)
                chosen.add(digest)
    return older_tokens, chosen


def _thinnest_first(
    config: TideConfig,
    reserve: dict[str, _Reserve],
    evidence: dict[str, int],
    window_tokens: dict[str, int],
    older_tokens: dict[str, int],
) -> list[str]:
    """The segments with reserved requests that the gate protects by their share (of
    the window or of the older traffic), the fewest judged output tokens first."""
    protected = protected_segments(
        list(reserve),
        token_shares(window_tokens),
        token_shares(older_tokens),
        config.gate.min_segment_share,
    )
    return sorted(protected, key=lambda name: (evidence.get(name, 0), name))


WINDOW_DIR = DataDirs.WINDOW  # export_training_data's layout: the trainer tells new traffic
REPLAY_DIR = DataDirs.REPLAY  # from replayed older traffic by these sub-directories
JUDGED_DIR = DataDirs.HELD_OUT  # and the held-out requests the gate judges, never trained on


@dataclasses.dataclass(frozen=True)
class TrainingSet:
    """What :func:`export_training_data` wrote: requests and their tokens, per part:
    ``window`` the traffic learned (the window's, and with ``cycle.relearn_older`` the
    earlier requests of the segments it learns), ``replay`` the older requests chosen by
    segment and the window's requests of segments the champion still fits. The snapshot's
    ``window_tokens``/``replay_tokens`` count the commits drawn, held-out requests
    included; these count what the trainer gets."""

    requests: dict[str, int]
    tokens: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def as_params(self) -> dict[str, int]:
        """The run's params: ``trained_window_requests``, ``trained_replay_tokens``, ..."""
        return {
            f"trained_{part}_{kind}": figures[part]
            for kind, figures in (("requests", self.requests), ("tokens", self.tokens))
            for part in (WINDOW_DIR, REPLAY_DIR)
        }


def export_training_data(config: TideConfig, snapshot: Snapshot, out: Path) -> TrainingSet:
    """Write the training set in SpecForge's layout: ``out/window/`` (the new traffic to
    learn) and ``out/replay/`` (traffic to keep), one ``.ckpt`` each, with its segment;
    and under ``out/held_out/`` the held-out requests the gate judges on, the window's
    and the older traffic's (:func:`_older_held_out`, in ``held_out/older/``), which the
    trainer scores its steps on and never trains on: a step it keeps has not forgotten
    older traffic on the very requests the gate will measure, nor fallen below its
    parent on the gate's window-weighted figure (``gate_figure.json``).

    Traffic to keep is older requests, chosen by segment toward those the window lacks
    (:mod:`.replay`), and the window's requests of segments the drift check found the
    champion still fits (:func:`_window_to_learn`): the trainer holds the draft close
    to the champion on them (distillation), so a cycle that learns Korean does not
    forget the English arriving beside it. Traffic to learn is the window's, and, when
    the drift check of a champion sends the cycle to learn (``cycle.relearn_older``), the
    earlier requests of the segments it learns among the older traffic read: a segment
    arriving over several windows is learned from all of them, not one at a time.

    A cycle left with nothing to learn learns the window it would keep
    (:func:`_learn_kept_window`). A consolidation cycle (a learning chain's end) learns
    the window and every segment's older requests it reads, and keeps nothing.

    Lake debris (a marker whose shard is gone, a corrupt shard, bad records) is
    quarantined or skipped, counted and logged; the cycle goes on without it.
    """
    reader = sample_reader(config)
    segmenter, _ = cycle_segmenter(config, snapshot)
    plan = _window_to_learn(config, snapshot, segmenter)
    counts = {WINDOW_DIR: 0, REPLAY_DIR: 0}
    tokens = {WINDOW_DIR: 0, REPLAY_DIR: 0}

    def learned(sample: CapturedRecord) -> bool:
        return plan.learns(segment_as_grouped(sample, plan.segmenter, segmenter))

    def save(sample: CapturedRecord, segment: str, window: bool) -> None:
        part = WINDOW_DIR if window and learned(sample) else REPLAY_DIR
        sample.save_specforge(out / part, counts[part], segment=segment)
        counts[part] += 1
        tokens[part] += int(sample.input_ids.numel())

    judged: set[bytes] = set()  # the held-out requests: a copy is never trained on

    def judge(segment: str, sample: CapturedRecord) -> None:  # scored while training
        part = WINDOW_DIR if learned(sample) else REPLAY_DIR
        sample.save_specforge(out / JUDGED_DIR / part, len(judged), segment=segment)

    window = _read_window(
        config,
        snapshot,
        reader,
        segmenter,
        judged,
        judge=judge,
        learn=lambda segment, sample: save(sample, segment, window=True),
    )
    window_tokens = window.tokens  # what the window carries, by segment
    window_requests = counts[WINDOW_DIR]
    # replay/ so far: the window's requests it keeps (its first files)
    kept_requests, kept_tokens = counts[REPLAY_DIR], tokens[REPLAY_DIR]
    _write_gate_figure(config, out, window_tokens)

    def relearned(sample: CapturedRecord, segment: str, digest: bytes) -> bool:
        if digest in window.digests or (segment not in window_tokens and not plan.consolidating):
            return False
        return plan.relearns(segment_as_grouped(sample, plan.segmenter, segmenter))

    window_judged = len(judged)
    reserved = _export_older_judged(
        config, snapshot, reader, judged, segmenter=segmenter, window=window, out=out
    )
    replay, older = _choose_replay(
        config,
        snapshot,
        reader,
        segmenter,
        window_tokens=window_tokens,
        judged=judged,  # the older requests judged too: never replayed nor learned
        relearned=relearned,
    )
    for sample, segment, learn in _read_chosen(reader, replay, older):
        save(sample, segment, window=learn)
    if not counts[WINDOW_DIR] and not _any_file(out / JUDGED_DIR / WINDOW_DIR):
        window_requests = _learn_kept_window(
            out, (kept_requests, kept_tokens), counts, tokens, snapshot.cycle_id
        )
    logger.info(
        "cycle %s: %d window training samples (%d of them earlier requests of the segments "
        "it learns), %d replay samples, and the %d held-out requests of the window and %d "
        "of older traffic (%d of them reserved for a thin segment) the gate judges on "
        "(scored while training, never trained on)",
        snapshot.cycle_id,
        counts[WINDOW_DIR],
        counts[WINDOW_DIR] - window_requests,
        counts[REPLAY_DIR],
        window_judged,
        len(judged) - window_judged,
        reserved,
    )
    log_debris(reader, f"cycle {snapshot.cycle_id} export")
    return TrainingSet(requests=counts, tokens=tokens)


def _read_chosen(
    reader: LakeReader, replay: list[ReplayCandidate], relearned: list[ReplayCandidate]
) -> Iterator[tuple[CapturedRecord, str, bool]]:
    """The chosen older requests, read from the commits that hold one, each once (copies
    under one id are one request): (sample, its segment, whether it is learned again)."""
    chosen = {candidate.key: (candidate, False) for candidate in replay}
    chosen |= {candidate.key: (candidate, True) for candidate in relearned}
    commits = sorted({candidate.commit for candidate, _learn in chosen.values()})
    for sample in reader.iter_records(markers_of(reader, commits)):
        found = chosen.pop(_replay_key(sample), None)
        if found is not None:
            candidate, learn = found
            yield sample, candidate.segment, learn


def _export_older_judged(
    config: TideConfig,
    snapshot: Snapshot,
    reader: LakeReader,
    judged: set[bytes],
    *,
    segmenter: Segmenter,
    window: _WindowRead,
    out: Path,
) -> int:
    """Write the older requests the gate judges to ``held_out/older/`` (scored as traffic
    to keep while training, never trained on; ``judged`` gains their digests, so they are
    neither replayed nor learned again) and keep the list of the reserved ones among them
    in the cycle's state for the gate (:func:`_older_held_out`); return how many those are."""
    index = len(judged)

    def write(segment: str, sample: CapturedRecord) -> None:
        nonlocal index
        sample.save_specforge(out / JUDGED_DIR / DataDirs.OLDER, index, segment=segment)
        index += 1

    _tokens, reserved = _older_held_out(
        config, snapshot, reader, judged, segmenter=segmenter, window=window, judge=write
    )
    listed = json.dumps(sorted(digest.hex() for digest in reserved)).encode()
    write_state(config, _reserved_name(snapshot.cycle_id), listed)
    return len(reserved)


def _any_file(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _learn_kept_window(
    out: Path,
    kept: tuple[int, int],
    counts: dict[str, int],
    tokens: dict[str, int],
    cycle_id: str,
) -> int:
    """A cycle that learns nothing (every window segment fits, and the segments it was
    sent to learn, still learning after a promotion, are not in this window nor among
    the older traffic read) learns the window it would keep: on replay alone it could
    not beat its parent (the demo's second cycle: 0 window samples, 59 replayed, then
    "no drift" at 0.64 of the oracle). The window's kept requests were saved first, so
    they are ``replay/``'s first files (``kept``: their requests and tokens); its
    held-out ones are scored as learned. Returns how many requests it moved."""
    moved, moved_tokens = kept
    if not moved:
        return 0
    names = [specforge_file_name(index) for index in range(moved)]
    _move(out / REPLAY_DIR, out / WINDOW_DIR, names)
    judged = out / JUDGED_DIR / REPLAY_DIR  # the window's alone (older ones: OLDER)
    _move(judged, out / JUDGED_DIR / WINDOW_DIR, sorted(p.name for p in judged.glob("*.ckpt")))
    counts[WINDOW_DIR], counts[REPLAY_DIR] = moved, counts[REPLAY_DIR] - moved
    tokens[WINDOW_DIR], tokens[REPLAY_DIR] = moved_tokens, tokens[REPLAY_DIR] - moved_tokens
    logger.info(
        "cycle %s: nothing in the window or the older traffic read is to be learned: "
        "learning the window's %d requests it would keep",
        cycle_id,
        moved,
    )
    return moved


def _move(source: Path, target: Path, names: list[str]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        (source / name).rename(target / name)


def _write_gate_figure(config: TideConfig, out: Path, window_tokens: dict[str, int]) -> None:
    """How the gate figures the window (``gate_figure.json``): the trainer keeps no step
    that does not gain ``gate.margin`` over its parent on it
    (:meth:`~tide_lib.training.selection.HeldOut.window_weighted`), nor one whose traffic
    to keep loses more than it gains (``gate.net_gain``)."""
    out.mkdir(parents=True, exist_ok=True)
    figure = {
        "shares": token_shares(window_tokens),
        "k": config.gate.k,
        "min_segment_tokens": config.gate.min_segment_tokens,
        "margin": config.gate.margin,
        "tolerance": config.gate.tolerance,
        "net_gain": config.gate.net_gain,
    }
    (out / DataDirs.GATE_FIGURE).write_text(json.dumps(figure))


def _every(_segment: str) -> bool:
    return True


def _none(_segment: str) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class _Learning:
    """What a cycle learns of its traffic (:func:`_window_to_learn`), by segment name."""

    learns: Callable[[str], bool]  # the window's segments learned (the rest are kept)
    segmenter: Segmenter  # what names them: the drift check's grouping
    relearns: Callable[[str], bool]  # segments whose earlier requests are learned too
    consolidating: bool = False  # every segment's older traffic learned, nothing kept


def _window_to_learn(config: TideConfig, snapshot: Snapshot, segmenter: Segmenter) -> _Learning:
    """Which of the window's segments a cycle learns (the rest it keeps, by distillation),
    the segmenter that names them (the headroom check's, the cycle's own), and
    which segments' earlier requests are learned too: those the drift check found the
    champion fell on (``cycle.relearn_older``), so that a segment arriving over several
    windows is learned from all of them, as a draft trained on it alone is. A segment
    learned only because this window held too little of it to judge keeps its earlier
    requests as replay: relearning them took the distillation that kept it (an English
    cluster with 28 window tokens was relearned with Korean law and fell 2.83 -> 1.98).
    Last, whether the cycle consolidates (``Drift.consolidate``): it learns every
    segment's older traffic, the window's segments or not, and keeps nothing.

    Every segment but those the check found the champion still fits; a check saved
    without that list (still learning, an older release) names what to learn itself.
    Without the check's segmenter those names mean nothing here: the window is learned.
    """
    drift = saved_drift(config, snapshot.cycle_id)
    if drift is None:
        return _Learning(_every, segmenter, _none)
    if drift.consolidate:
        return _Learning(_every, segmenter, _every, consolidating=True)
    # only on a check of a champion: not when training unconditionally (no champion yet,
    # the check off or failed), which would relearn the same older traffic every cycle
    drifted = set(drift.drifted)
    relearn = config.cycle.relearn_older and drift.champion_drifted
    drift_segmenter = segmenter
    if drift.segmenter_key:
        drift_segmenter = stored_segmenter(config, drift.segmenter_key) or segmenter
        if drift_segmenter is segmenter and (drift.drifted or drift.fitting):
            logger.warning("cycle %s: learning the whole window", snapshot.cycle_id)
            return _Learning(_every, segmenter, _none)

    fitting = None if drift.fitting is None else set(drift.fitting)

    def learns(segment: str) -> bool:
        if fitting is not None:
            return segment not in fitting
        return not drifted or segment in drifted

    def relearns(segment: str) -> bool:
        return relearn and segment in drifted

    return _Learning(learns, drift_segmenter, relearns)


def _replay_key(sample: CapturedRecord, digest: bytes | None = None) -> str:
    """A record's identity for the replay: its request id and content (ids can repeat;
    ``digest``: its :func:`content_digest`, when the caller has it already)."""
    return f"{sample.request_id}/{(digest or content_digest(sample.input_ids)).hex()}"


def _choose_replay(
    config: TideConfig,
    snapshot: Snapshot,
    reader: LakeReader,
    segmenter: Segmenter,
    *,
    window_tokens: dict[str, int],
    judged: set[bytes],
    relearned: Callable[[CapturedRecord, str, bytes], bool],
) -> tuple[list[ReplayCandidate], list[ReplayCandidate]]:
    """Older requests to replay, by segment (:mod:`.replay`), and those to learn again
    (``relearned``: earlier requests of a segment the cycle learns).

    The candidates are the requests of the older held-out commits that the gate does
    not judge (held out by the content hash, or in ``judged``: reserved for a thin
    segment);
    this pass keeps their segments and sizes, not their states (the caller reads the
    commits of the chosen ones again). Requests learned again take no replay budget:
    the budget is split by the older traffic left to keep.
    """
    older_tokens: dict[str, int] = {}
    candidates: list[ReplayCandidate] = []
    learned: list[ReplayCandidate] = []
    for marker in markers_of(reader, snapshot.held_out_older):
        for sample in reader.iter_records([marker]):
            segment, tokens = segment_of(sample, segmenter), int(sample.input_ids.numel())
            older_tokens[segment] = older_tokens.get(segment, 0) + tokens
            digest = content_digest(sample.input_ids)
            if _held_out(sample, config.cycle.held_out_percent, digest):
                continue
            if digest not in judged:
                key = _replay_key(sample, digest)
                candidate = ReplayCandidate(key, segment, tokens, marker.key)
                (learned if relearned(sample, segment, digest) else candidates).append(candidate)
    # a segment learned again, none of it kept, takes no share of the replay budget (the
    # drift check's groups can split a cluster: one with requests to keep keeps its share)
    for segment in {c.segment for c in learned} - {c.segment for c in candidates}:
        older_tokens.pop(segment)
    budget = config.cycle.replay_share * snapshot.window_tokens
    quotas = replay_quotas(
        budget,
        older_tokens,
        window_tokens,
        floor=config.cycle.replay_min_segment_share,
        floor_from=config.gate.min_segment_share,
    )
    logger.info(
        "cycle %s: replay budget %.0f tokens by segment %s (older traffic %s, window %s)",
        snapshot.cycle_id,
        budget,
        {segment: round(quota) for segment, quota in sorted(quotas.items())},
        dict(sorted(older_tokens.items())),
        dict(sorted(window_tokens.items())),
    )
    return choose_replay(candidates, quotas, seed=snapshot.cycle_id), learned


@dataclasses.dataclass
class HeldOutTraffic:
    """What the gate judges on, by segment: held-out requests (with the reserved ones of
    a thin segment, :func:`_older_held_out`) and token shares.

    ``window_tokens`` counts every request of the window (held out or not): the
    weights of the gate; ``window_held_out`` how many of each segment's samples (the
    first ones) are the window's: the gain the gate asks for is measured on them.
    ``older_tokens`` counts the requests of the older commits drawn for the held-out
    budget (held out or not): the share that keeps traffic which stopped arriving
    protected.
    """

    samples: dict[str, list[CapturedRecord]]
    window_tokens: dict[str, int]
    older_tokens: dict[str, int]
    segmenter_key: str
    # Each segment's first this many samples are the window's (the rest older traffic).
    window_held_out: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def window_shares(self) -> dict[str, float]:
        return token_shares(self.window_tokens)

    @property
    def older_shares(self) -> dict[str, float]:
        return token_shares(self.older_tokens)

    @property
    def output_tokens(self) -> dict[str, int]:
        """Held-out output tokens per segment: how much each gate figure rests on."""
        return {
            segment: sum(int(sample.loss_mask.sum()) for sample in samples)
            for segment, samples in self.samples.items()
        }


def held_out_traffic(config: TideConfig, snapshot: Snapshot) -> HeldOutTraffic:
    """The gate's traffic, read from the lake: held-out requests of the window and of the
    older commits, grouped by segment (a client's label, else the cycle's clusters)."""
    segmenter, key = cycle_segmenter(config, snapshot)
    reader = sample_reader(config)
    samples: dict[str, list[CapturedRecord]] = {}
    seen: set[bytes] = set()  # a request judged once, however often it was sent

    def judge(segment: str, sample: CapturedRecord) -> None:
        samples.setdefault(segment, []).append(sample)

    window = _read_window(config, snapshot, reader, segmenter, seen, judge=judge)
    window_held_out = {segment: len(judged) for segment, judged in samples.items()}
    older_tokens, _reserved = _older_held_out(
        config,
        snapshot,
        reader,
        seen,
        segmenter=segmenter,
        window=window,
        judge=judge,
        reserved=_exported_reserve(config, snapshot.cycle_id),
    )
    log_debris(reader, f"cycle {snapshot.cycle_id} held-out")
    return HeldOutTraffic(samples, window.tokens, older_tokens, key, window_held_out)


def _exported_reserve(config: TideConfig, cycle_id: str) -> set[bytes] | None:
    """The reserved requests the cycle's export set aside for the gate (None: no export
    kept a readable list, as before a cycle trains: the gate then chooses them as it
    would)."""
    name = _reserved_name(cycle_id)
    listed = read_state(config, name)
    if listed is None:
        return None
    try:
        digests = json.loads(listed)
        if not isinstance(digests, list):
            raise TypeError(f"a JSON list of hex digests expected, not {type(digests).__name__}")
        return {bytes.fromhex(digest) for digest in digests}
    except (ValueError, TypeError) as error:  # not JSON, or not a list of hex digests
        logger.warning(
            "cycle %s: the export's list of reserved requests (%s) is unreadable (%s); "
            "the gate chooses them as the export would, and may judge one the cycle "
            "replayed if a shard went missing since. To judge exactly what the export "
            "chose, clear export_training_data and the tasks after it.",
            cycle_id,
            state_key(config, name),
            error,
        )
        return None


def held_out_samples(config: TideConfig, snapshot: Snapshot) -> dict[str, list[CapturedRecord]]:
    """The gate's held-out requests by segment (see :func:`held_out_traffic`)."""
    return held_out_traffic(config, snapshot).samples

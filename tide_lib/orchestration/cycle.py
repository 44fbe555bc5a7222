"""One adaptation cycle, as the steps ``tide_adaptation`` runs (one function per task).

Each step takes the typed configuration and what earlier steps returned: the
typed hand-offs of :mod:`tide_lib.orchestration.handoff` (lake keys, MLflow ids,
URIs; never a local path, since the steps run on different hosts). Whatever a
step needs locally it downloads into a scratch directory of its own, removed when
it ends. Each step is safe to rerun:

- the **snapshot** of a cycle is written once to the lake and read back on a rerun;
- **registration** finds the version a cycle already registered;
- **promotion** of a version that is already champion does nothing;
- the **watermark** only moves forward, and only in the last step.

State lives in the lake bucket under ``<prefix>/_state/target=<slug>/``
(:mod:`tide_lib.orchestration.state`); the drift check that decides whether a
cycle trains at all is :mod:`tide_lib.orchestration.drift_check`; what the train
and evaluate steps read of the lake (the window, its held-out requests, the
replay) is :mod:`tide_lib.orchestration.export`.
"""

from __future__ import annotations

__all__ = [
    "advance_watermark",
    "apply_retention",
    "check_drift",
    "cycle_segmenter",
    "evaluate_and_gate",
    "new_tokens",
    "promote",
    "read_watermark",
    "register",
    "rollback",
    "snapshot_window",
    "task_scratch",
    "train",
]

import dataclasses
import hashlib
import json
import logging
import random
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tide_lib.config import GateConfig, TideConfig, TrainConfig
from tide_lib.evaluation.offline import AcceptanceCount, drop_margin, no_room_to_gain
from tide_lib.lake import LakeReader, target_slug
from tide_lib.lake.layout import CommitMarker, commit_stamp_key, commit_time
from tide_lib.lake.reader import watermark
from tide_lib.names import Tags
from tide_lib.orchestration.continuation import (
    drop_continuation,
    fetch_continuation,
    keep_continuation,
)
from tide_lib.orchestration.drift_check import (
    REPLAY_RULE,
    check_drift,
    record_trial,
    saved_drift,
    version_acceptance,
)
from tide_lib.orchestration.export import (
    HeldOutTraffic,
    export_training_data,
    held_out_traffic,
)
from tide_lib.orchestration.handoff import Decision, Drift, Promotion, Snapshot, Trained
from tide_lib.orchestration.state import (
    cycle_segmenter,
    draft_registry,
    lake_reader,
    lake_store,
    log_debris,
    read_state,
    state_key,
    task_scratch,
    write_state,
)

if TYPE_CHECKING:
    from tide_lib.evaluation.gate import GateDecision, PooledFigures
    from tide_lib.registry import DraftRegistry
    from tide_lib.serving.fleet import FleetManager

logger = logging.getLogger(__name__)


def read_watermark(config: TideConfig) -> str | None:
    """The order (a commit key, see ``CommitMarker.order``) up to which the lake is consumed."""
    saved = read_state(config, _WATERMARK)
    value: str | None = json.loads(saved)["watermark"] if saved is not None else None
    return value


def new_tokens(config: TideConfig) -> int:
    """Captured tokens committed after the watermark (what the sensor waits on)."""
    slug = target_slug(config.cycle.target_id)
    return lake_reader(config).count_tokens(slug, after=read_watermark(config), settled=True)


def cycle_tokens(config: TideConfig, cycle_id: str) -> int:
    """What the sensor compares with ``min_new_tokens``.

    A cycle that already froze its window (a rerun) has its window's tokens: the
    data it consumes no longer counts as new once the watermark moved past it.
    """
    saved = _saved_snapshot(config, cycle_id)
    return saved.window_tokens if saved is not None else new_tokens(config)


_WATERMARK = "watermark.json"


def _snapshot_name(cycle_id: str) -> str:
    return f"cycles/{cycle_id}.json"


def _saved_snapshot(config: TideConfig, cycle_id: str) -> Snapshot | None:
    saved = read_state(config, _snapshot_name(cycle_id))
    return Snapshot.model_validate_json(saved) if saved is not None else None


def snapshot_window(config: TideConfig, cycle_id: str) -> Snapshot:
    """Freeze this cycle's inputs: the new window, a replay budget, an older held-out budget.

    Older commits are drawn from the ``cycle.replay_lookback_hours`` before the
    watermark, listed by key alone; only the markers chosen are read. So the
    snapshot's cost follows the window and the budgets, not the lake's age.
    """
    saved = _saved_snapshot(config, cycle_id)
    if saved is not None:
        logger.info("cycle %s: reusing its snapshot (%d shards)", cycle_id, len(saved.window))
        return saved
    slug = target_slug(config.cycle.target_id)
    reader = lake_reader(config)
    before = read_watermark(config)
    window = reader.list_shards(slug, after=before, settled=True)
    if not window:
        raise RuntimeError(
            f"no committed shards for {slug} after watermark {before} that are at least "
            f"{config.lake.commit_settle_s:g} s old (lake.commit_settle_s)"
        )
    window_tokens = sum(m.num_tokens for m in window)
    after = watermark(window, before)
    assert after is not None  # the window is not empty
    older = _older_keys(config, reader, slug, before)
    shuffled = random.Random(cycle_id).sample(older, len(older))
    replay = _take(reader, shuffled, config.cycle.replay_share * window_tokens)
    # Held-out requests never train (replay skips them), so the replayed commits hold
    # the first of the older held-out traffic; more commits only if they fall short.
    held_out_tokens = config.cycle.held_out_older_tokens * 100 / config.cycle.held_out_percent
    taken = {m.key for m in replay}
    extra = _take(
        reader,
        [key for key in shuffled if key not in taken],
        held_out_tokens - sum(m.num_tokens for m in replay),
    )
    held_out = replay + extra
    snapshot = Snapshot(
        cycle_id=cycle_id,
        target_id=config.cycle.target_id,
        watermark_before=before,
        watermark_after=after,
        window=[m.key for m in window],
        replay=sorted(m.key for m in replay),
        held_out_older=sorted(m.key for m in held_out),
        window_tokens=window_tokens,
        replay_tokens=sum(m.num_tokens for m in replay),
        older_listed=len(older),
    )
    write_state(config, _snapshot_name(cycle_id), snapshot.model_dump_json().encode())
    logger.info(
        "cycle %s: window of %d shards (%d tokens); replay %d and older held-out %d shards "
        "drawn from %d older commits",
        cycle_id,
        len(window),
        window_tokens,
        len(replay),
        len(held_out),
        len(older),
    )
    log_debris(reader, f"cycle {cycle_id} snapshot")
    return snapshot


def _older_keys(
    config: TideConfig, reader: LakeReader, slug: str, watermark: str | None
) -> list[str]:
    """Commit keys within the replay lookback before the watermark (a listing, no reads)."""
    if watermark is None:
        return []
    since = commit_time(watermark) - timedelta(hours=config.cycle.replay_lookback_hours)
    start = commit_stamp_key(config.lake.prefix, slug, since)
    return reader.commit_keys(slug, after=start, until=watermark)


def _take(reader: LakeReader, keys: list[str], budget_tokens: float) -> list[CommitMarker]:
    """Markers from ``keys``, in order, until their tokens reach the budget."""
    taken: list[CommitMarker] = []
    tokens = 0
    for key in keys:
        if tokens >= budget_tokens:
            break
        marker = reader.marker(key)
        if marker is not None:
            taken.append(marker)
            tokens += marker.num_tokens
    return taken


def _training_settings(config: TideConfig, cycle_id: str) -> TrainConfig:
    """The trainer's settings for this cycle: the last step when promotion is forced; any
    gain over a champion its drift check found no longer fitting (``warm_gain: any``: a
    window's few held-out requests hid real gains on the traffic it fell on; the gate
    still judges the draft), else a gain beyond the noise. A champion never judged (a
    seeded one) is not known not to fit: the segments its first check found far below
    its best may be traffic no draft serves better (first cycles registered challengers
    below their parent), so a gain over it must be beyond the noise. A consolidation
    cycle learns every segment's traffic: up to ``cycle.consolidate_max_steps``; from the
    baseline draft (:func:`_train_in_run`) at the full rate for
    ``cycle.consolidate_epochs`` passes, at least ``training.steps``."""
    return _settings_for(config, saved_drift(config, cycle_id), from_floor=False)


def _settings_for(config: TideConfig, drift: Drift | None, *, from_floor: bool) -> TrainConfig:
    """:func:`_training_settings` for a saved verdict ``drift``; ``from_floor``: the run
    starts from the baseline draft (:func:`_consolidation_start`)."""
    if config.cycle.force_promote:  # promote what was trained, whatever it scores
        return config.training.model_copy(update={"export": "last"})
    training = config.training
    if drift is not None and drift.consolidate:  # every segment's traffic: more to learn
        training = training.model_copy(update=_consolidation_recipe(config, from_floor))
    if drift is not None and drift.champion_drifted and drift.champion_judged:
        training = training.model_copy(update={"warm_gain": "any"})
    return training


def _consolidation_recipe(config: TideConfig, from_floor: bool) -> dict[str, Any]:
    """A consolidation's training settings: up to ``cycle.consolidate_max_steps`` steps
    at the warm-start recipe from the champion; from the baseline draft, the full rate
    for ``cycle.consolidate_epochs`` passes, ``training.steps`` at least (the warm-start
    recipe, ten passes at half the rate, left it short of the champion it must beat)."""
    steps = config.cycle.consolidate_max_steps
    if not from_floor:
        return {"warm_max_steps": steps}
    return {
        "warm_lr_scale": 1.0,
        "warm_epochs": config.cycle.consolidate_epochs,
        "warm_min_steps": min(config.training.steps, steps),
        "warm_max_steps": steps,
    }


def _checkpoint_prefix(config: TideConfig, cycle_id: str) -> str:
    return state_key(config, f"cycles/{cycle_id}/checkpoints")


def train(config: TideConfig, snapshot: Snapshot) -> Trained:
    """Train the cycle's challenger on this (trainer) host; hand back an MLflow artifact URI.

    Warm-starts from the champion. Checkpoints are mirrored to the lake bucket, so
    a retry on any trainer host resumes; the draft goes to the run's artifacts. The
    cycle has one MLflow run: a failed attempt marks it FAILED, a retry resumes it,
    and a retry after the draft was logged reuses that draft. A run whose best
    checkpoint was the parent records what it gained on the segments it was sent to learn
    (:func:`~tide_lib.orchestration.drift_check.record_trial`).
    """
    registry = draft_registry(config)
    cycle_id = snapshot.cycle_id
    registered = registry.find_by_tag(Tags.CYCLE_ID, cycle_id)
    if registered is not None and registered.run_id:
        logger.info("cycle %s trained v%s before: reusing it", cycle_id, registered.version)
        return Trained(
            run_id=registered.run_id,
            draft_uri=registered.source,
            parent_version=registered.tags.get(Tags.PARENT_VERSION) or None,
        )
    run_id, parent_version = registry.cycle_run(cycle_id)
    try:
        tags = registry.run_tags(run_id)
        draft_uri, improved = tags.get(Tags.DRAFT_URI), tags.get(Tags.BEST_IS_PARENT) != "true"
        if draft_uri:
            logger.info("cycle %s: run %s logged its draft before: reusing it", cycle_id, run_id)
        else:
            draft_uri, improved = _train_in_run(config, registry, snapshot, run_id, parent_version)
    except BaseException:
        registry.end_run(run_id, "FAILED")  # never left RUNNING; a retry resumes it
        raise
    registry.end_run(run_id)
    if not improved and parent_version is not None:  # no step beat it beyond the noise
        # on a retry too (idempotent): the outcome may have been recorded before a crash;
        # a segment its best step gained on (kept back by the gate's figure) is not settled
        record_trial(config, cycle_id, _learned_gains(registry.run_tags(run_id)), gain=0.0)
    return Trained(
        run_id=run_id, draft_uri=draft_uri, parent_version=parent_version, improved=improved
    )


def _learned_gains(tags: dict[str, str]) -> dict[str, float]:
    """The run's :data:`Tags.LEARNED_GAINS` (none when absent or unreadable)."""
    try:
        gains = json.loads(tags.get(Tags.LEARNED_GAINS) or "{}")
    except ValueError:
        return {}
    return {str(s): float(g) for s, g in gains.items()} if isinstance(gains, dict) else {}


def _log_window_dataset(
    config: TideConfig, registry: DraftRegistry, snapshot: Snapshot, run_id: str
) -> None:
    """The lake window the run trains on, as its MLflow dataset input: the snapshot's
    object (which lists every commit read), a digest of those commits and token counts."""
    commits = sorted(snapshot.window + snapshot.replay)
    digest = hashlib.sha256("\n".join(commits).encode()).hexdigest()[:16]
    key = state_key(config, _snapshot_name(snapshot.cycle_id))
    registry.log_dataset(
        run_id,
        name=f"lake-{snapshot.target_id}-{snapshot.cycle_id}",
        uri=f"s3://{config.store.lake_bucket}/{key}",
        digest=digest,
        profile={
            "window_tokens": snapshot.window_tokens,
            "replay_tokens": snapshot.replay_tokens,
            "window_commits": len(snapshot.window),
            "replay_commits": len(snapshot.replay),
            "watermark_before": snapshot.watermark_before,
            "watermark_after": snapshot.watermark_after,
        },
    )


def _train_in_run(
    config: TideConfig,
    registry: DraftRegistry,
    snapshot: Snapshot,
    run_id: str,
    parent_version: str | None,
) -> tuple[str, bool]:
    """Train in ``run_id`` and log the draft to it; returns its URI and whether it improved.

    When the best checkpoint on held-out traffic was the parent itself, nothing new is
    logged: the URI is the parent's registered model and the cycle registers nothing.
    """
    from tide_lib.training.launch import TrainJob, run_training  # noqa: PLC0415

    cycle_id = snapshot.cycle_id
    try:
        _log_window_dataset(config, registry, snapshot, run_id)
    except Exception as error:  # lineage for the record, never a reason to fail training
        logger.warning("cycle %s: could not log the window as a dataset input: %s", cycle_id, error)
    with task_scratch(config, f"train-{cycle_id}") as work:
        exported = export_training_data(config, snapshot, work / "data")
        parent = registry.download(parent_version, work / "parent") if parent_version else None
        drift = saved_drift(config, cycle_id)
        floor, floor_version = _consolidation_start(
            config, registry, drift, parent_version, work / "floor"
        )
        if floor_version is not None:  # it relearns every segment, as a fresh draft
            logger.info(
                "cycle %s: consolidating from the baseline draft v%s", cycle_id, floor_version
            )
        training = _settings_for(config, drift, from_floor=floor is not None)
        job = TrainJob(
            data_dir=work / "data",
            target_dir=config.cycle.target_path,
            out_dir=work / "run",
            training=training,
            parent_dir=parent,
            start_dir=floor or fetch_continuation(config, parent_version, work / "start"),
            checkpoint_prefix=_checkpoint_prefix(config, cycle_id),
            mlflow_run_id=run_id,
        )
        result = run_training(job, config)
        improved = not (result.best_is_parent and parent_version)
        if improved:
            draft_uri = registry.log_draft(run_id, result.draft_dir)
        else:
            draft_uri = registry.model_uri(str(parent_version))
            _clear_checkpoints(config, cycle_id)  # register, which clears them, will not run
            _log_kept_parent(cycle_id, parent_version, result.evaluations)
        registry.record_run(
            run_id,
            params={
                "window_tokens": snapshot.window_tokens,
                "replay_tokens": snapshot.replay_tokens,
                "trained_steps": result.steps,
                "started_from": _start_name(floor_version, job.start_dir, parent_version),
                **exported.as_params(),
            },
            # in order, the draft's URI last: it marks the outcome complete
            tags={
                Tags.BEST_IS_PARENT: str(not improved).lower(),
                # none when a step was exported: that run leaves no continuation
                Tags.LEARNED_GAINS: json.dumps(
                    {s: round(g, 4) for s, g in result.learned_gains().items()}
                ),
                Tags.DRAFT_URI: draft_uri,
            },
        )
        # once the outcome is recorded: a retry before it trains from the same start
        if floor is None:  # a consolidation from the floor neither takes nor leaves one
            _hand_on(config, parent_version, job.start_dir, result.continuation_dir)
    return draft_uri, improved


def _start_name(floor: str | None, start: Path | None, parent_version: str | None) -> str:
    """What a run started from, as its params say: a baseline, a continuation, a parent."""
    if floor is not None:
        return f"baseline v{floor}"
    if parent_version is None:
        return "a new draft"
    return f"{'a continuation of ' if start is not None else ''}v{parent_version}"


def _consolidation_start(
    config: TideConfig,
    registry: DraftRegistry,
    drift: Drift | None,
    parent_version: str | None,
    out: Path,
) -> tuple[Path | None, str | None]:
    """The baseline draft (the gate's floor), downloaded to ``out``, and its version, when
    this cycle consolidates from it (``cycle.consolidate_from: baseline``) and it is not
    the champion itself; else Nones (the champion, or its continuation, is the start)."""
    from tide_lib.registry import BASELINE  # noqa: PLC0415

    if drift is None or not drift.consolidate or config.cycle.consolidate_from != "baseline":
        return None, None
    floor = registry.alias(BASELINE)
    if floor is None or floor.version == parent_version:
        return None, None
    return registry.download(floor.version, out), floor.version


def _log_kept_parent(
    cycle_id: str, parent_version: str | None, evaluations: list[dict[str, Any]]
) -> None:
    logger.info(
        "cycle %s: no checkpoint beat the parent v%s on held-out traffic (%s): nothing to register",
        cycle_id,
        parent_version,
        ", ".join(f"step {e['step']}: {e['accept_length']:.3f}" for e in evaluations),
    )


def _hand_on(
    config: TideConfig, parent_version: str | None, started: Path | None, left: Path | None
) -> None:
    """A run that kept its parent and rose above it leaves its own continuation (in place
    of the one it started from: the same keys, so no moment holds neither); one that
    started from a continuation and leaves none consumed it
    (:mod:`~tide_lib.orchestration.continuation`)."""
    if parent_version is None:
        return
    if left is not None:
        keep_continuation(config, parent_version, left)
    elif started is not None:
        drop_continuation(config, parent_version)


def register(config: TideConfig, snapshot: Snapshot, trained: Trained) -> str:
    """Register the challenger from its URI (once per cycle); drop the cycle's checkpoints."""
    import specforge  # noqa: PLC0415

    version = draft_registry(config).register(
        trained.draft_uri,
        trained.run_id,
        cycle_id=snapshot.cycle_id,
        tags={
            Tags.WINDOW_AFTER: str(snapshot.watermark_before),
            Tags.WINDOW_UNTIL: snapshot.watermark_after,
            Tags.WINDOW_TOKENS: str(snapshot.window_tokens),
            Tags.REPLAY_TOKENS: str(snapshot.replay_tokens),
            Tags.PARENT_VERSION: str(trained.parent_version or ""),
            Tags.SPECFORGE_VERSION: getattr(specforge, "__version__", "0.2.0"),
            **_consolidation_tag(config, snapshot.cycle_id),
        },
    )
    _clear_checkpoints(config, snapshot.cycle_id)
    return version.version


def _consolidation_tag(config: TideConfig, cycle_id: str) -> dict[str, str]:
    """:data:`Tags.CONSOLIDATED` for a version a consolidation cycle trained: it ends a
    chain, and its own first check without drift starts none."""
    drift = saved_drift(config, cycle_id)
    return {Tags.CONSOLIDATED: "true"} if drift is not None and drift.consolidate else {}


def _clear_checkpoints(config: TideConfig, cycle_id: str) -> None:
    """Drop the cycle's training checkpoints from the lake bucket (done with them)."""
    from tide_lib.training.launch import CheckpointMirror  # noqa: PLC0415

    prefix = _checkpoint_prefix(config, cycle_id)
    CheckpointMirror(config, prefix, config.training.keep_checkpoints).clear()


def _record_gate_trial(config: TideConfig, cycle_id: str, decision: GateDecision) -> None:
    """What the gate measured the challenger gain, per segment it protected (measured on
    enough held-out traffic) and on the window as a whole, kept for the next headroom
    checks (:func:`record_trial`)."""
    champion = decision.weighted_champion
    whole = None if champion is None else decision.weighted_challenger - champion
    protected = {s: g for s, g in decision.gains().items() if s in decision.protected}
    record_trial(config, cycle_id, protected, gain=whole)


def evaluate_and_gate(
    config: TideConfig, snapshot: Snapshot, trained: Trained, version: str
) -> Decision:
    """Offline acceptance of challenger and champion per segment; the gate's decision.

    Held-out traffic comes from the lake and both drafts from the registry: this
    step needs nothing from the host that trained. The gate judges at ``gate.k``;
    the figures at the other ``gate.ks`` are recorded with it. Both drafts are
    replayed with a round from every output position (:func:`version_acceptance`).
    """
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415
    from tide_lib.evaluation.tracking import log_decision  # noqa: PLC0415
    from tide_lib.training.specforge_runtime import prepare_specforge  # noqa: PLC0415

    del trained  # the registered version is what is judged
    prepare_specforge("cpu")
    k = config.gate.k
    registry = draft_registry(config)
    tags = registry.get(version).tags
    decision = decision_from_tags(tags, k)
    if decision is not None:
        logger.info("v%s was judged before: %s", version, decision.reason)
        _record_gate_trial(config, snapshot.cycle_id, decision)  # a retry after a crash
    else:
        traffic = held_out_traffic(config, snapshot)
        registry.set_tags(
            version, {Tags.SEGMENTER: traffic.segmenter_key, Tags.GATE_REPLAY: REPLAY_RULE}
        )
        decision = _judge(config, registry, snapshot, version, traffic)
        log_decision(registry, version, decision, k)
        _record_gate_trial(config, snapshot.cycle_id, decision)
    return Decision(
        promote=decision.promote or config.cycle.force_promote,
        reason=decision.reason,
        challenger=decision.challenger,
        champion=decision.champion,
    )


def _judge(
    config: TideConfig,
    registry: DraftRegistry,
    snapshot: Snapshot,
    version: str,
    traffic: HeldOutTraffic,
) -> GateDecision:
    """Measure challenger, champion (and the floor draft) on the held-out traffic at every
    k; decide at gate.k."""
    from tide_lib.evaluation.gate import decide  # noqa: PLC0415

    k, min_tokens = config.gate.k, config.gate.min_segment_tokens
    ks = sorted({k, *config.gate.ks})
    champion_version, floor_version = _references(config, registry, version)
    with task_scratch(config, f"evaluate-{snapshot.cycle_id}") as work:

        def counts(number: str) -> dict[int, dict[str, AcceptanceCount]]:
            return version_acceptance(config, registry, number, traffic.samples, ks=ks, work=work)

        challenger_counts = counts(version)
        champion_counts = counts(champion_version) if champion_version else None
        floor_counts = counts(floor_version) if floor_version else None
    challenger = _lengths(challenger_counts)
    champion = _lengths(champion_counts) if champion_counts else None
    window = _window_with_room(
        champion_counts[k] if champion_counts else {}, traffic.window_held_out, k, config.gate
    )
    floor = _lengths(floor_counts)[k] if floor_counts else None
    decision = decide(
        challenger[k],
        champion[k] if champion else None,
        config.gate,
        weights=traffic.window_shares,
        older_shares=traffic.older_shares,
        held_out_tokens=traffic.output_tokens,
        drop_margins=_drop_margins(champion_counts, challenger_counts, k),
        pooled=_pooled(champion_counts[k], challenger_counts[k]) if champion_counts else None,
        floor=floor,
        floor_margins=_drop_margins(floor_counts, challenger_counts, k),
        window_figures=(
            _window_lengths(challenger_counts[k], window, min_tokens),
            _window_lengths(champion_counts[k], window, min_tokens) if champion_counts else {},
        ),
    )
    return dataclasses.replace(
        decision,
        challenger_by_k={at_k: f for at_k, f in challenger.items() if at_k != k},
        champion_by_k={at_k: f for at_k, f in (champion or {}).items() if at_k != k},
        floor_version=floor_version if floor is not None else None,
    )


def _references(
    config: TideConfig, registry: DraftRegistry, version: str
) -> tuple[str | None, str | None]:
    """The champion and the floor draft (``baseline``, when ``gate.floor`` and it is
    neither the challenger nor the champion) the challenger is judged against."""
    from tide_lib.registry import BASELINE, CHAMPION  # noqa: PLC0415

    champion = registry.alias(CHAMPION)
    champion_version = champion.version if champion and champion.version != version else None
    if not config.gate.floor or champion_version is None:
        return champion_version, None
    floor = registry.alias(BASELINE)
    if floor is None or floor.version in (version, champion_version):
        return champion_version, None
    return champion_version, floor.version


def _window_lengths(
    counts: dict[str, AcceptanceCount], window: dict[str, int], min_tokens: int
) -> dict[str, float]:
    """Each segment's acceptance length on its window requests alone (the first
    ``window[segment]`` of its held-out requests); segments whose window requests hold
    fewer than ``min_tokens`` output tokens (``gate.min_segment_tokens``: one or two
    requests are noise) are left out, and measured on all their requests. The gate
    replays a round from every output position, so verify steps count output tokens,
    the same for every draft: both are measured on the same requests."""
    lengths = {}
    for segment, count in counts.items():
        alone = AcceptanceCount.of(count.per_request[: window.get(segment, 0)])
        if alone.verify_steps >= max(min_tokens, 1):
            lengths[segment] = alone.accept_length
    return lengths


def _window_with_room(
    champion: dict[str, AcceptanceCount], window: dict[str, int], k: int, gate: GateConfig
) -> dict[str, int]:
    """``window`` (each segment's count of window requests among its held-out ones), but
    0 for a segment whose window requests leave the champion no room to gain
    (:func:`~tide_lib.evaluation.offline.no_room_to_gain` by ``gate.margin``: short
    answers at their ceiling): that segment's gain is measured on its older held-out
    requests too, as the trainer's selection measures it (which pools them too where
    the window's are fewer than ``gate.min_segment_tokens``, as rule 4 does)."""
    full = {
        segment
        for segment, count in window.items()
        if segment in champion
        and no_room_to_gain(champion[segment].per_request[:count], k, gate.margin)
    }
    if full:
        logger.info(
            "the champion serves the window's held-out requests of %s within gate.margin "
            "%.3f of their ceiling: their gain is measured on their older ones too",
            sorted(full),
            gate.margin,
        )
    return {segment: 0 if segment in full else count for segment, count in window.items()}


def _drop_margins(
    before: dict[int, dict[str, AcceptanceCount]] | None,
    after: dict[int, dict[str, AcceptanceCount]],
    k: int,
) -> dict[str, float]:
    """The noise of each segment's drop from ``before`` to ``after`` at ``k``: the same
    requests, paired."""
    if not before:
        return {}
    return {
        segment: drop_margin(before[k][segment].per_request, count.per_request)[1]
        for segment, count in after[k].items()
        if segment in before[k]
    }


def _pooled(
    champion: dict[str, AcceptanceCount], challenger: dict[str, AcceptanceCount]
) -> PooledFigures:
    """The gate's measure of segments judged together: their requests pooled, paired."""

    def figures(segments: tuple[str, ...]) -> tuple[float, float, float]:
        before = AcceptanceCount.of(pair for s in segments for pair in champion[s].per_request)
        after = AcceptanceCount.of(pair for s in segments for pair in challenger[s].per_request)
        margin = drop_margin(before.per_request, after.per_request)[1]
        return before.accept_length, after.accept_length, margin

    return figures


def _lengths(counts: dict[int, dict[str, AcceptanceCount]]) -> dict[int, dict[str, float]]:
    return {k: {s: count.accept_length for s, count in by.items()} for k, by in counts.items()}


def promote(config: TideConfig, version: str, decision: Decision) -> Promotion:
    """Roll the version out to the fleet, then move ``champion``/``previous-champion``.

    Engines are handed ``models:/<name>/<version>`` and download it themselves.
    """
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    registry = draft_registry(config)
    if not decision.promote or config.cycle.dry_run:
        why = "dry run" if config.cycle.dry_run else decision.reason
        logger.info("not promoting v%s: %s", version, why)
        return Promotion(promoted=False, reason=why)
    current = registry.alias(CHAMPION)
    if current is not None and current.version == version:
        registry.promote(version)  # a retry after the alias moved: finishes the tags
        return Promotion(promoted=False, reason=f"v{version} is already champion")
    if registry.get(version).tags.get(Tags.PROMOTED) == "true":
        why = f"v{version} was promoted before; serve it again with tide_rollback"
        logger.info("not promoting: %s", why)
        return Promotion(promoted=False, reason=why)
    if config.cycle.servers:
        _fleet(config).promote(
            *_served(registry, version),
            rollback_to=_served(registry, current.version) if current else None,
        )
    registry.promote(version)
    return Promotion(promoted=True, reason=decision.reason)


def _fleet(config: TideConfig) -> FleetManager:
    from tide_lib.serving.fleet import FleetManager, RestartLauncher  # noqa: PLC0415

    serve, fleet = config.serve, config.fleet
    launcher = None
    if fleet.rollout == "restart" and fleet.restart_command:
        launcher = RestartLauncher(fleet.restart_command, timeout_s=fleet.restart_timeout_s)
    return FleetManager(
        config.cycle.servers,
        api_key=serve.api_key,
        admin_api_key=serve.admin_api_key,
        launcher=launcher,
    )


def _served(registry: DraftRegistry, version: str) -> tuple[str, str]:
    """What engines are handed for ``version``: its URI and its weight version."""
    return registry.model_uri(version), f"{registry.name}-v{version}"


def advance_watermark(config: TideConfig, snapshot: Snapshot) -> str:
    """Mark the window consumed; never moves backwards."""
    current = read_watermark(config)
    consumed_until = snapshot.watermark_after
    if current is not None and current >= consumed_until:
        return current
    consumed = {"watermark": consumed_until, "cycle_id": snapshot.cycle_id}
    write_state(config, _WATERMARK, json.dumps(consumed).encode())
    return consumed_until


def rollback(config: TideConfig, version: str, run_id: str | None = None) -> dict[str, Any]:
    """Serve an earlier version (a number, or an alias such as ``previous-champion``).

    With the DAG run's ``run_id``, the version it resolved is kept in the lake, so a
    retry of that run goes to the same version (``previous-champion`` moves once the
    first attempt promoted) and, once that version is champion, does nothing.
    """
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    registry = draft_registry(config)
    remembered = _rollback_target(config, run_id) if run_id else None
    if remembered is not None:
        number = remembered
        champion = registry.alias(CHAMPION)
        if champion is not None and champion.version == number:
            logger.info("rollback %s served v%s before: nothing to do", run_id, number)
            return {"version": number}
        logger.info("rollback %s: resuming the rollback to v%s", run_id, number)
    else:
        number = _resolve_version(registry, version)
        if run_id:
            resolved = {"requested": version, "version": number}
            write_state(config, _rollback_name(run_id), json.dumps(resolved).encode())
    if config.cycle.servers:
        current = registry.alias(CHAMPION)
        _fleet(config).promote(
            *_served(registry, number),
            rollback_to=_served(registry, current.version) if current else None,
        )
    registry.promote(number)
    logger.info("rolled %s back to v%s", registry.name, number)
    return {"version": number}


def _resolve_version(registry: DraftRegistry, version: str) -> str:
    resolved = registry.alias(version) if not version.isdigit() else None
    number = resolved.version if resolved is not None else version
    if not number.isdigit():
        raise ValueError(
            f"{registry.name} has no version or alias {version!r}: give a registered version "
            "number or an alias (champion, previous-champion)"
        )
    return number


def _rollback_name(run_id: str) -> str:
    return f"rollbacks/{run_id}.json"


def _rollback_target(config: TideConfig, run_id: str) -> str | None:
    """The version an earlier attempt of DAG run ``run_id`` resolved, if any."""
    saved = read_state(config, _rollback_name(run_id))
    number: str | None = json.loads(saved)["version"] if saved is not None else None
    return number


def _beyond_skew(config: TideConfig, marker: CommitMarker) -> bool:
    """A marker that landed further behind its stamp than cycles look back (logged)."""
    late = commit_time(marker.order) - commit_time(marker.key)
    if late <= timedelta(seconds=config.lake.max_clock_skew_s):
        return False
    logger.warning(
        "keeping %s: it landed %.0f s after its stamp, more than lake.max_clock_skew_s, so "
        "cycles may not have seen it; fix the clock of writer %s, raise max_clock_skew_s, "
        "or delete it and its shard %s by hand once it is not needed",
        marker.key,
        late.total_seconds(),
        marker.writer_id,
        marker.shard_key,
    )
    return True


def apply_retention(config: TideConfig, now: Any = None) -> dict[str, int]:
    """Delete consumed shards older than ``lake.retention_days``; never unconsumed ones.

    A marker goes before its shard: a crash in between leaves a shard no reader
    sees (harmless), never a marker without its shard. Whether a marker is consumed
    is judged by its order, so a late marker of a writer whose clock is behind
    is kept until a cycle took it; one stamped further behind than
    ``lake.max_clock_skew_s`` may never have been listed by a cycle, so it is kept
    (and logged) rather than judged.
    """
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415

    store, reader = lake_store(config), lake_reader(config)
    slug = target_slug(config.cycle.target_id)
    consumed_until = read_watermark(config)
    cutoff = (now or datetime.now(UTC)) - timedelta(days=config.lake.retention_days)
    deleted = kept_unconsumed = 0
    for marker in reader.list_shards(slug):
        if marker.max_finished_at >= cutoff:
            continue
        if consumed_until is None or marker.order > consumed_until or _beyond_skew(config, marker):
            kept_unconsumed += 1
            continue
        store.remove(marker.key)
        store.remove(marker.shard_key)
        deleted += 1
    logger.info(
        "retention on %s: deleted %d shards older than %s, kept %d not yet consumed",
        slug,
        deleted,
        cutoff.isoformat(),
        kept_unconsumed,
    )
    return {"deleted": deleted, "kept_unconsumed": kept_unconsumed}

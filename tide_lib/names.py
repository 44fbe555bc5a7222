"""Names every host and tool agrees on: target slugs, registered model names, aliases,
and the MLflow tags TIDE writes on draft versions (the one place they are spelled).

Here, apart from the lake and registry packages, because DAG files need them while
the dag-processor parses (for their Assets), and that must import nothing heavy
(no pyarrow, minio, torch or mlflow). ``tide_lib.lake`` and ``tide_lib.registry``
re-export them.
"""

from __future__ import annotations

__all__ = [
    "BASELINE",
    "CHALLENGER",
    "CHAMPION",
    "PREVIOUS_CHAMPION",
    "DataDirs",
    "Tags",
    "registered_model_name",
    "target_slug",
]

import re
from typing import Final

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"
# The draft that sets the gate's floor (gate.floor): the first champion unless moved.
BASELINE = "baseline"


class DataDirs:
    """Sub-directories of an exported training set: the cycle's export writes them on the
    training host, the trainer reads them. Traffic to learn, traffic to keep (replayed,
    distilled), and the held-out requests the gate judges, scored while training, never
    trained on: the window's (``held_out/window/`` and ``held_out/replay/``, by the part
    they would train in) and the older traffic's (``held_out/older/``, scored in groups
    of their own, ``older/<segment>``, so they never dilute a group the window learns)."""

    WINDOW: Final = "window"
    REPLAY: Final = "replay"
    HELD_OUT: Final = "held_out"
    OLDER: Final = "older"
    # how the gate figures the window (JSON, at the root): each segment's share of the
    # window's tokens, its k and min_segment_tokens; the trainer keeps no step below its
    # parent on that figure
    GATE_FIGURE: Final = "gate_figure.json"


class Tags:
    """MLflow tag keys of TIDE's registered models and versions (``{segment}``/``{k}``
    are filled in). Tags identify and record decisions; figures are metrics too."""

    TARGET_ID: Final = "tide.target_id"  # on the registered model
    # lineage of a version
    CYCLE_ID: Final = "tide.cycle_id"  # the DAG run that trained it: one version per cycle
    PARENT_VERSION: Final = "tide.parent_version"
    # "true" on a version a consolidation cycle trained (every segment's traffic at once)
    CONSOLIDATED: Final = "tide.consolidated"
    DRAFT_URI: Final = "tide.draft_uri"
    BEST_IS_PARENT: Final = "tide.best_is_parent"  # on a run: its best checkpoint was the parent
    # on a run that kept its parent: its held-out gain per segment (JSON), what it learned
    LEARNED_GAINS: Final = "tide.learned_gains"
    SPECFORGE_VERSION: Final = "tide.specforge_version"  # the SpecForge that trained it
    # its window: the commits after one watermark, up to and with the next
    WINDOW_AFTER: Final = "tide.window.after"
    WINDOW_UNTIL: Final = "tide.window.until"
    WINDOW_TOKENS: Final = "tide.window.tokens"
    REPLAY_TOKENS: Final = "tide.replay.tokens"  # older traffic replayed beside the window
    PROMOTED: Final = "tide.promoted"  # "true" once it has been champion
    SEGMENTER: Final = "tide.segmenter"  # lake key of the segmenter the figures grouped by
    # how the gate replayed the drafts ("every_position"); figures without it are an older
    # release's engine rounds, never a baseline for today's measurements
    GATE_REPLAY: Final = "tide.gate.replay"
    # the gate's decision (tide_lib.evaluation.gate writes and reads them)
    ACCEPT_LENGTH: Final = "tide.al.{segment}.k{k}"
    CHAMPION_ACCEPT_LENGTH: Final = "tide.gate.champion_al.{segment}.k{k}"
    FLOOR_ACCEPT_LENGTH: Final = "tide.gate.floor_al.{segment}.k{k}"  # the baseline's
    FLOOR_VERSION: Final = "tide.gate.floor_version"
    # on the window's held-out requests alone: what the gain is measured on
    WINDOW_ACCEPT_LENGTH: Final = "tide.gate.window_al.{segment}.k{k}"
    CHAMPION_WINDOW_ACCEPT_LENGTH: Final = "tide.gate.champion_window_al.{segment}.k{k}"
    WEIGHT: Final = "tide.gate.weight.{segment}"  # its share of the window's tokens
    OLDER_SHARE: Final = "tide.gate.older_share.{segment}"  # its share of older traffic
    PROTECTED: Final = "tide.gate.protected"  # segments that may not fall (JSON list)
    PROTECTED_TOGETHER: Final = "tide.gate.protected_together"  # traffic to keep, pooled
    REASON: Final = "tide.gate.reason"
    WEIGHTED: Final = "tide.gate.weighted_accept_length"
    WEIGHTED_CHAMPION: Final = "tide.gate.weighted_champion_accept_length"
    DECISION: Final = "tide.gate.decision"  # written last: it marks the record complete

    @staticmethod
    def of_decision(key: str) -> bool:
        """Whether ``key`` is one of the gate decision's tags (not ``GATE_REPLAY``, which
        says how the figures were measured and is set before judging)."""
        return key.startswith(("tide.al.", "tide.gate.")) and key != Tags.GATE_REPLAY


_SLUG_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def target_slug(target_id: str) -> str:
    """A path- and registry-safe name.

    ``meta-llama/Llama-3.1-8B`` becomes ``meta-llama--llama-3.1-8b``.
    """
    slug = _SLUG_UNSAFE.sub("-", target_id.strip().lower().replace("/", "--")).strip("-.")
    if not slug:
        raise ValueError(f"target id {target_id!r} has no characters usable in a slug")
    return slug


def registered_model_name(target_id: str) -> str:
    """``tide-draft-<slug>``: the MLflow registered model of a target's drafts."""
    return f"tide-draft-{target_slug(target_id)}"

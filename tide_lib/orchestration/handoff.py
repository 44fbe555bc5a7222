"""What one cycle step hands the next: small typed values that mean the same on every host.

The steps of ``tide_adaptation`` run on different hosts (``train`` on the ``mi250``
trainers, the rest on ``default`` workers, engines elsewhere), so a hand-off can
only carry what every host resolves for itself: lake object keys, MLflow run and
model-version ids, and ``s3://``, ``runs:/`` or ``models:/`` URIs. Never a local
path. Each model travels through XCom as JSON (``to_xcom``) and is validated
again when the next step reads it (``from_xcom``), so a malformed value fails at
the edge with the field named.
"""

from __future__ import annotations

__all__ = ["Decision", "Drift", "HandOff", "Promotion", "Snapshot", "Trained"]

from typing import Any, Self

from pydantic import Field, field_validator

from tide_lib.config import StrictModel
from tide_lib.registry.uris import PORTABLE_SCHEMES, is_portable


class HandOff(StrictModel):
    """Base of the hand-offs: immutable, unknown keys refused, as configuration sections;
    a field's docstring is its description."""

    def to_xcom(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_xcom(cls, value: Self | dict[str, Any]) -> Self:
        return value if isinstance(value, cls) else cls.model_validate(value)


class Snapshot(HandOff):
    """The frozen inputs of one cycle, chosen once from commit markers and stored in the lake.

    Every list holds commit-marker keys; the cycle reads nothing else. Its size is
    set by the window, the replay budget and the older held-out budget, never by
    the lake's age.
    """

    cycle_id: str
    target_id: str
    watermark_before: str | None
    watermark_after: str
    window: list[str]
    """commits after the watermark: the new traffic"""
    replay: list[str]
    """older commits drawn first (the start of held_out_older); their tokens size the draw, the
    replay itself is chosen by segment from all of held_out_older"""
    held_out_older: list[str]
    """older commits whose held-out requests judge forgetting; their other requests are the replay
    candidates, chosen by segment"""
    window_tokens: int = Field(ge=0)
    replay_tokens: int = Field(ge=0)
    older_listed: int = Field(ge=0)
    """older commit keys listed to choose from"""

    def asset_extra(self) -> dict[str, Any]:
        """What the lake asset's event says about this window (no keys, just figures)."""
        return {
            "cycle_id": self.cycle_id,
            "window_tokens": self.window_tokens,
            "replay_tokens": self.replay_tokens,
            "window_commits": len(self.window),
            "watermark_after": self.watermark_after,
        }


class Trained(HandOff):
    """The challenger a trainer host produced, stored where every host can read it."""

    run_id: str
    draft_uri: str
    """the exported draft as an MLflow artifact URI"""
    parent_version: str | None
    improved: bool = True
    """False when the best checkpoint on held-out traffic was the parent itself: nothing worth
    registering"""

    @field_validator("draft_uri")
    @classmethod
    def _portable(cls, value: str) -> str:
        if not is_portable(value):
            raise ValueError(
                f"draft_uri {value!r} is not a URI another host can resolve "
                f"(expected one of {', '.join(PORTABLE_SCHEMES)})"
            )
        return value


class Drift(HandOff):
    """Whether the cycle trains: the champion serves a segment of the window well below what
    a draft reaches on it (headroom, :mod:`tide_lib.evaluation.headroom`)."""

    drift: bool
    reason: str
    champion_version: str | None
    measured: dict[str, float]
    """champion's acceptance length per segment"""
    margins: dict[str, float] = Field(default_factory=dict)
    """one-sided 95% margin of error of each measured figure (absent: too few requests to estimate
    one, so its fall cannot count)"""
    baseline: dict[str, float]
    """each segment's estimate of what a draft reaches on it, the check's reference"""
    shares: dict[str, float] = Field(default_factory=dict)
    """each measured segment's share of the window's tokens (absent: all of it)"""
    ceilings: dict[str, float] = Field(default_factory=dict)
    """the most any draft reaches on each measured segment's requests (what their output lengths
    allow): no segment is held to more"""
    drifted: list[str] = Field(default_factory=list)
    """segments with headroom (and thinner ones below their estimate): the segments learned.
    Without `fitting`: these are learned and the rest of the window is kept (empty: learn all)"""
    fitting: list[str] | None = None
    """segments without headroom: the window's requests of these are trained as traffic to keep,
    the others learned. None: every segment has headroom (learn the whole window)"""
    champion_judged: bool = True
    """false: no cycle's gate promoted the champion (a seeded one): a gain over it must be beyond
    the noise (training.warm_gain is left as set), and it does not consolidate"""
    saved_train_seconds: float | None = None
    """no headroom: the last trained cycle's training time, not spent"""
    consolidate: bool = False
    """the cycle consolidates (the champion was warm-started, or, with consolidate_each_drift, any
    champion a cycle's gate promoted): it learns every segment's older traffic in the lookback with
    the window (cycle.consolidate)"""
    segmenter_key: str | None = None
    """lake key of the segmenter whose segments `drifted`, `fitting` and the figures name (the
    cycle's own)"""

    @property
    def champion_drifted(self) -> bool:
        """Did a champion's check name segments of the window with headroom? Not when
        training without such a finding: no champion yet, the check off or failed."""
        return self.drift and self.champion_version is not None and bool(self.drifted)


class Decision(HandOff):
    """The gate's verdict on a registered version, with the figures it judged."""

    promote: bool
    reason: str
    challenger: dict[str, float]
    champion: dict[str, float] | None


class Promotion(HandOff):
    """What the promote step did."""

    promoted: bool
    reason: str

"""The typed settings of the harness's commands, light enough for ``tide --help``.

Each benchmark takes one of these models; ``tide bench ... --help`` lists its
fields as flags (``add_config_options``), so the CLI, the defaults and the
JSON's "params" come from one place.
"""

from __future__ import annotations

__all__ = [
    "AdaptationBenchParams",
    "CycleBenchParams",
    "DemoSettings",
    "LakeBenchParams",
    "ServeBenchParams",
    "SuiteParams",
    "TrainBenchParams",
]

from pathlib import Path
from typing import Literal

from pydantic import Field

from tide_lib.config import StrictModel, TrainConfig


class LakeBenchParams(StrictModel):
    """What ``tide bench lake`` writes; its flags."""

    records: int = Field(256, ge=1, description="records to write")
    tokens_per_record: int = Field(256, ge=1, description="tokens of each record")
    hidden_size: int = Field(1024, ge=1, description="target hidden size H")
    distinct_payloads: int = Field(8, ge=1, description="random payloads the records cycle through")


class CycleBenchParams(StrictModel):
    """The lakes ``tide bench cycle`` builds; its flags."""

    scales: tuple[int, ...] = Field((1, 10, 100), description="older-lake sizes (x the 1x lake)")
    older_shards: int = Field(24, ge=1, description="older shards at 1x (over the lookback)")
    window_shards: int = Field(8, ge=1, description="shards of the new window")
    records_per_shard: int = Field(2, ge=1, description="records in each shard")
    tokens_per_record: int = Field(64, ge=1, description="tokens of each record")
    hidden_size: int = Field(64, ge=1, description="target hidden size H of the records")
    lookback_hours: float = Field(24.0, gt=0, description="replay lookback the older lake spans")
    held_out_older_tokens: int = Field(256, ge=0, description="older tokens held out for the gate")
    replay_share: float = Field(0.5, ge=0, le=4, description="replay share of the training mix")


class TrainBenchParams(StrictModel):
    """What ``tide bench train`` trains; its flags."""

    samples: int = Field(64, ge=1, description="captured requests")
    steps: int = Field(16, ge=1, description="optimizer steps per mode")
    batch_size: int = Field(4, ge=1, description="samples per step")
    ttt_length: int = Field(7, ge=1, description="test-time-training unroll length")
    draft_vocab_size: int = Field(2048, ge=1, description="draft vocabulary (<= the target's)")


SETTLE_HELP = (
    "requests adaptive k serves beside plain decoding after the warm-up and before the "
    "timed passes, while it learns what pays (their ratio is reported apart: the cost of "
    "learning, which a serving engine pays once)"
)


class ServeBenchParams(StrictModel):
    """What ``tide bench serve`` runs; its flags."""

    draft: Path | None = Field(
        None, description="exported draft to serve (omitted: bootstraps one)"
    )
    prompts: int = Field(24, ge=1, description="held-out prompts per pair")
    max_new_tokens: int = Field(48, ge=1, description="tokens generated per request")
    speculative_num_steps: int = Field(4, ge=1, description="k, and adaptive k's largest")
    warmup: int = Field(4, ge=0, description="untimed requests per engine before measuring")
    settle: int = Field(12, ge=0, description=SETTLE_HELP)
    passes: int = Field(
        2, ge=1, description="timed passes over the prompts (each pass's ratio is reported)"
    )


class AdaptationBenchParams(StrictModel):
    """How ``tide bench adaptation`` replays a workload; its flags."""

    cycle_tokens: int = Field(1500, ge=1, description="new tokens per cycle")
    max_new_tokens: int = Field(48, ge=1, description="tokens per request without its own")
    ks: tuple[int, ...] = Field((3, 5), description="draft tokens per verify to measure at")
    held_out_percent: int = Field(20, ge=1, le=99, description="requests held out to measure on")
    timing_passes: int = Field(
        3,
        ge=1,
        description="timed passes over the new segment's held-out prompts "
        "(each pass's ratio to plain decoding is reported)",
    )
    settle: int = Field(12, ge=0, description=SETTLE_HELP)
    labels: bool = Field(
        False,
        description="send each request's segment as a client label (custom_labels); "
        "else segments come from the cycles' clusters",
    )
    static_steps: int = Field(
        0,
        ge=0,
        description="training steps of the static draft (0: 4 x training.steps, "
        "a draft fitted to its traffic as a deployed one is, not one a cycle still improves)",
    )
    target_seed: int = Field(
        0,
        ge=0,
        description="seed of the demo target's build (tide target build --seed): another "
        "seed builds another target, so that figures need not rest on one build; its "
        "default directory is .tide/targets/demo-seed<N>",
    )
    oracle_seeds: int = Field(
        3,
        ge=1,
        description="oracle drafts trained, one per seed (training.seed + 0, 1, ...): the "
        "oracle's figure pools them, as one training run on a window's few hundred tokens "
        "moves it by tenths",
    )
    joint: bool = Field(
        True,
        description="also train a draft on every segment's traffic the cycles' windows held "
        "(the oracle's recipe, one seed): how near one draft serving all the segments comes "
        "to the oracle of the new one alone, a reference for the adapted draft",
    )
    fresh: int = Field(
        48,
        ge=0,
        description="requests the workload never sent, per segment named english, "
        "english-docs, korean or korean-law, drawn from the packaged corpus: retention and "
        "the new segment's ratios are measured on them too (a dozen held-out requests move "
        "them by tenths)",
    )


class SuiteParams(StrictModel):
    """What ``tide bench suite`` draws and measures; its flags."""

    seeds: int = Field(8, ge=1, description="workloads to draw, one per seed (kinds in turn)")
    seed_base: int = Field(
        0,
        ge=0,
        description="the first workload's seed; judge a change on seeds it was not tuned on",
    )
    kinds: tuple[Literal["new", "turns", "gradual", "return", "served", "none"], ...] = Field(
        (), description="only workloads of these kinds (new, turns, gradual, return, served, none)"
    )
    cycles: float = Field(6.0, gt=0, description="cycles of traffic each workload spans, about")
    cycle_tokens: int = Field(700, ge=1, description="new tokens per cycle")
    pool: int = Field(120, ge=4, description="distinct corpus requests per segment")
    held_out_percent: int = Field(
        20, ge=1, le=99, description="pool requests held out to measure on"
    )
    max_new_tokens: int = Field(48, ge=1, description="tokens generated per request")
    k: int = Field(5, ge=1, description="draft tokens per verify the figures are at")
    static_steps: int = Field(
        480, ge=1, description="training steps of the static drafts and oracles (a fixed recipe)"
    )
    target_seed: int = Field(0, ge=0, description="seed of the demo target's build")
    cache_dir: Path = Field(
        Path(".tide/suite"), description="where the shared drafts are kept between runs"
    )


class DemoSettings(StrictModel):
    """What one demo run does; ``tide demo --help`` lists them as flags."""

    preset: Literal["demo", "tiny"] = Field("demo", description="target size (tiny: a test run)")
    cycles: int = Field(3, ge=1, description="adaptation cycles to run")
    engines: int = Field(2, ge=1, le=4, description="reference engines in the fleet")
    num_steps: int = Field(3, ge=1, le=8, description="draft tokens per verify (k)")
    max_new_tokens: int = Field(32, gt=0, description="tokens generated per request")
    tokens_per_cycle: int = Field(4000, gt=0, description="new captured tokens a cycle waits for")
    static_prompts: int = Field(120, gt=0, description="English prompts the static draft learns")
    train_steps: int = Field(120, gt=0, description="training steps per cycle")
    ttt_length: int = Field(4, ge=1, description="test-time-training unroll length")
    learning_rate: float = Field(2e-3, gt=0)
    draft_vocab_size: int = Field(2048, gt=0, description="draft vocabulary (<= the target's)")
    refresh_s: float = Field(15.0, gt=0, description="seconds between table rows")
    request_pause_s: float = Field(0.2, ge=0, description="pause between replayed requests")
    force_promote: bool = Field(False, description="promote even when the gate rejects")
    engine_port: int = Field(30100, ge=1, le=65000, description="first engine port")
    timeout_s: float = Field(3600.0, gt=0, description="give up after this long")

    def training(self, base: TrainConfig) -> TrainConfig:
        return base.model_copy(
            update={
                "steps": self.train_steps,
                "ttt_length": self.ttt_length,
                "learning_rate": self.learning_rate,
                "draft_vocab_size": self.draft_vocab_size,
            }
        )

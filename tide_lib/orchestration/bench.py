"""``tide bench adaptation``: the TIDE loop, headless, on any workload file.

The workload is JSONL, one request per line in order of arrival:
``{"prompt": "...", "segment": "...", "max_new_tokens": 48}`` (the last key is
optional); the last segment to appear is the new traffic. A share of each
segment's requests is held out for evaluation and never captured.

1. A static draft is bootstrapped from the target's greedy answers to the older
   segments' requests and registered as champion.
2. The remaining requests are served in order by the reference engine (capture
   on, real S3 lake). Whenever the new captured tokens since the watermark cross
   ``cycle_tokens``, one adaptation cycle runs with the same library functions
   as the ``tide_adaptation`` DAG (snapshot, train warm-started from the
   champion with replay, register, evaluate + gate, promote), and the engine
   swaps the new champion in; the time from the threshold to serving is kept.
3. An oracle draft is trained offline on all of the new traffic.
4. Every draft is evaluated offline on the held-out requests of each segment,
   for each k; the static and the final adapted draft are also timed side by
   side on held-out new-traffic prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.lake import target_slug
from tide_lib.lake.reader import TrainingSample

__all__ = ["WorkloadError", "demo_workload", "load_workload", "run_adaptation_bench"]

logger = logging.getLogger(__name__)


class WorkloadError(ValueError):
    """A workload file line is malformed; the message names the line."""


def load_workload(path: Path) -> list[dict[str, Any]]:
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{path}:{number}: not JSON ({error})") from error
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("prompt"), str)
            or not item["prompt"]
        ):
            raise WorkloadError(f'{path}:{number}: needs a non-empty "prompt" string')
        if not isinstance(item.get("segment"), str) or not item["segment"]:
            raise WorkloadError(f'{path}:{number}: needs a non-empty "segment" string')
        unknown = set(item) - {"prompt", "segment", "max_new_tokens"}
        if unknown:
            raise WorkloadError(f"{path}:{number}: unknown keys {sorted(unknown)}")
        requests.append(item)
    if len({item["segment"] for item in requests}) < 2:
        raise WorkloadError(
            f"{path}: needs at least two segments (older traffic, then new traffic)"
        )
    return requests


def demo_workload(
    path: Path, *, english: int = 60, korean: int = 120, max_new_tokens: int = 48
) -> Path:
    """The demo's traffic: English conversation, then Korean conversation (packaged corpus)."""
    from tide_lib.target import load_corpus, render_prompt  # noqa: PLC0415

    corpus = load_corpus()
    lines = [
        json.dumps(
            {
                "prompt": render_prompt(doc.turns[0]),
                "segment": segment,
                "max_new_tokens": max_new_tokens,
            }
        )
        for segment, domain, count in (
            ("english", "en_chat", english),
            ("korean", "ko_chat", korean),
        )
        for doc in corpus.domain(domain)[:count]
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _held_out(index: int, prompt: str, percent: int) -> bool:
    return hashlib.sha256(f"{index}:{prompt}".encode()).digest()[0] * 100 // 256 < percent


def _held_out_samples(
    target_dir: Path, items: list[dict[str, Any]], default_max: int
) -> list[TrainingSample]:
    """The target's greedy answers to held-out prompts, with their states (as serving captures)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from tide_lib.serving.speculative import SpeculativeDecoder  # noqa: PLC0415

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    decoder = SpeculativeDecoder(target, None, 1, tokenizer.eos_token_id)
    samples = []
    for index, item in enumerate(items):
        ids = tokenizer.encode(item["prompt"], add_special_tokens=False)
        generation = decoder.generate(
            ids, int(item.get("max_new_tokens", default_max)), speculative=False
        )
        samples.append(generation.training_sample(f"held-out-{index}"))
    return samples


def run_adaptation_bench(
    config: TideConfig,
    workload: Path,
    json_path: Path | None,
    *,
    target_dir: Path,
    preset: str = "demo",
    cycle_tokens: int = 1500,
    max_new_tokens: int = 48,
    ks: tuple[int, ...] = (3, 5),
    held_out_percent: int = 20,
    train: TrainConfig | None = None,
) -> dict[str, Any]:
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.orchestration import cycle  # noqa: PLC0415
    from tide_lib.registry import CHAMPION, DraftRegistry  # noqa: PLC0415
    from tide_lib.serving.bench import _engine, _side_by_side, bootstrap_draft  # noqa: PLC0415
    from tide_lib.serving.engine import EngineRequest  # noqa: PLC0415
    from tide_lib.target import build_target  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415
    from tide_lib.training.trainer import train_draft  # noqa: PLC0415

    requests = load_workload(workload)
    build_target(target_dir, preset_name=preset)
    train = train or config.training
    segments = list(dict.fromkeys(item["segment"] for item in requests))
    new_segment = segments[-1]
    held = [i for i, item in enumerate(requests) if _held_out(i, item["prompt"], held_out_percent)]
    served = [item for i, item in enumerate(requests) if i not in set(held)]
    target_id = f"bench-adapt-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="tide-bench-adapt-") as tmp:
        work = Path(tmp)
        run_config = config.model_copy(
            update={
                "scratch_dir": work / "scratch",
                "lake": config.lake.model_copy(
                    update={
                        "prefix": f"bench-{target_id}",
                        "spool_dir": work / "spool",
                        "shard_max_age_s": 0.5,
                        "commit_settle_s": 0.0,  # one writer, flushed before each read
                    }
                ),
                "cycle": config.cycle.model_copy(
                    update={
                        "target_id": target_id,
                        "target_path": target_dir,
                        "servers": [],
                        "min_new_tokens": cycle_tokens,
                    }
                ),
                "training": train,
            }
        )
        older_prompts = [item["prompt"] for item in served if item["segment"] != new_segment]
        static_dir = bootstrap_draft(
            target_dir, older_prompts, work / "static", max_new_tokens=max_new_tokens, train=train
        )
        registry = DraftRegistry(config.mlflow.tracking_uri, target_id)
        registry.seed_champion(static_dir)

        engine = _engine(
            run_config,
            target_dir,
            static_dir,
            capture=True,
            served_model_name=target_id,
            draft_sources=[str(work / "served")],  # where each promoted version is downloaded
        )
        versions: dict[str, Path] = {"static": static_dir}
        threshold_to_serving: list[float] = []
        cycles_run = 0
        try:
            for index, item in enumerate(tqdm(served, desc="workload", unit="req")):
                ids = engine.encode(item["prompt"])
                engine.submit(
                    EngineRequest(
                        ids,
                        int(item.get("max_new_tokens", max_new_tokens)),
                        0.0,
                        None,
                        f"w-{index}",
                    )
                ).result()
                if item["segment"] != new_segment:
                    continue
                assert engine.writer is not None
                engine.writer.flush(timeout=60)
                if cycle.new_tokens(run_config) < cycle_tokens:
                    continue
                crossed = time.perf_counter()
                cycles_run += 1
                cycle_id = f"cycle-{cycles_run}"
                snapshot = cycle.snapshot_window(run_config, cycle_id)
                trained = cycle.train(run_config, snapshot)
                version = cycle.register(run_config, snapshot, trained)
                decision = cycle.evaluate_and_gate(run_config, snapshot, trained, version)
                cycle.promote(run_config, version, decision)
                champion = registry.alias(CHAMPION)
                if champion is not None and champion.version == version:
                    local = registry.download(version, work / "served" / f"v{version}")
                    engine.swap_draft(str(local), f"v{version}")
                    threshold_to_serving.append(time.perf_counter() - crossed)
                    versions[f"adapted-v{version}"] = local
                cycle.advance_watermark(run_config, snapshot)
            assert engine.writer is not None
            engine.writer.flush(timeout=60)
        finally:
            engine.close()

        # Oracle: all of the new traffic (held-out excluded), offline, from the static draft.
        from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415

        reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), run_config.lake)
        oracle_data = work / "oracle-data"
        new_ids = {f"w-{i}" for i, item in enumerate(served) if item["segment"] == new_segment}
        count = 0
        for sample in reader.iter_samples(reader.list_shards(target_slug(target_id))):
            if sample.request_id in new_ids:
                oracle_data.mkdir(parents=True, exist_ok=True)
                torch.save(sample.to_specforge(), oracle_data / f"data_{count:06d}.ckpt")
                count += 1
        oracle_steps = train.steps * max(1, len(versions) - 1)
        versions["oracle"] = train_draft(
            oracle_data,
            target_dir,
            work / "oracle",
            train.model_copy(update={"steps": oracle_steps}),
            parent_dir=static_dir,
        ).draft_dir

        held_items = [requests[i] for i in held]
        held_samples = _held_out_samples(target_dir, held_items, max_new_tokens)
        by_segment = {
            segment: [
                s
                for s, item in zip(held_samples, held_items, strict=True)
                if item["segment"] == segment
            ]
            for segment in segments
        }
        accept: dict[str, dict[str, dict[str, float]]] = {}
        for name, path in versions.items():
            counts = offline_acceptance(
                load_draft(path, target_dir), target_dir, by_segment, list(ks)
            )
            accept[name] = {
                segment: {f"k{k}": by_k[k].accept_length for k in ks}
                for segment, by_k in counts.items()
            }
        final = [name for name in versions if name.startswith("adapted-")]
        final_name = final[-1] if final else "static"

        static_engine = _engine(run_config, target_dir, static_dir, capture=False)
        final_engine = _engine(run_config, target_dir, versions[final_name], capture=False)
        try:
            prompts = [
                static_engine.encode(item["prompt"])
                for item in held_items
                if item["segment"] == new_segment
            ]
            timing = _side_by_side(
                {"static": static_engine, "adapted": final_engine}, prompts, max_new_tokens
            )
        finally:
            static_engine.close()
            final_engine.close()

    def ratio(a: str, b: str, k: int) -> float:
        denominator = accept[b][new_segment][f"k{k}"]
        return accept[a][new_segment][f"k{k}"] / denominator if denominator else 0.0

    result: dict[str, Any] = {
        "accept_length": accept,
        "al_ratio_adapted_static": {f"k{k}": ratio(final_name, "static", k) for k in ks},
        "al_ratio_adapted_oracle": {f"k{k}": ratio(final_name, "oracle", k) for k in ks},
        "tokens_per_s_static": timing["static"]["tokens"] / timing["static"]["seconds"],
        "tokens_per_s_adapted": timing["adapted"]["tokens"] / timing["adapted"]["seconds"],
        "threshold_to_serving_s": threshold_to_serving,
        "final_adapted": final_name,
        "cycles": cycles_run,
        "new_segment": new_segment,
        "segments": segments,
        "requests": {"served": len(served), "held_out": len(held)},
        "params": {
            "cycle_tokens": cycle_tokens,
            "max_new_tokens": max_new_tokens,
            "ks": list(ks),
            "train_steps_per_cycle": train.steps,
            "workload": str(workload),
        },
        "measured_at": datetime.now(UTC).isoformat(),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result

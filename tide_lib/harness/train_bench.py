"""``tide bench train``: what reusing captured hidden states saves over recomputing them.

For each target shape, captures of English conversations go through the real lake
(writer -> S3 -> reader -> SpecForge's offline layout); then the same EAGLE3
training runs twice: on the captured states (reuse, what TIDE does), and with
the target re-run on the token ids for every sample (recompute, what training
without captures must do). Shapes: the demo target TIDE built, and a
random-weight target with the depth and width ratios of Llama-3.1-8B scaled
down, because the ratio depends on how large the target is next to the draft.
"""

from __future__ import annotations

__all__ = ["TrainBenchParams", "run_train_bench"]

import dataclasses
import json
import logging
import resource
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.harness.params import TrainBenchParams
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.target_model import PRESETS, build_target, load_corpus, model_config
from tide_lib.target_model.hidden import capture_records
from tide_lib.training.trainer import train_draft

logger = logging.getLogger(__name__)


def _scaled_llama_8b(demo_target: Path, out_dir: Path) -> Path:
    """Llama-3.1-8B's shape (32 layers, FFN 3.5x, GQA 4:1) at the demo's width (1/16 of
    its 4096), over the demo's tokenizer, random weights."""
    from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    shape = dataclasses.replace(
        PRESETS["demo"], num_layers=32, num_kv_heads=1, intermediate_size=896
    )
    torch.manual_seed(0)
    LlamaForCausalLM(model_config(shape, tokenizer)).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _window_from_lake(config: TideConfig, target_dir: Path, samples: int, work: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    documents = load_corpus().domain("en_chat", held_out=False)[:samples]
    target_id = f"tide-bench/{target_dir.name}-{work.name}"
    store = ObjectStore(config.store, config.store.lake_bucket)
    lake = config.lake.model_copy(update={"spool_dir": work / "spool"})
    with LakeWriter(store, lake) as writer:
        for record in capture_records(model, tokenizer, documents, target_id=target_id):
            if not writer.submit(record):
                raise RuntimeError("the lake writer dropped a benchmark record")
    reader = LakeReader(store, lake)
    shards = reader.list_shards(target_slug(target_id))
    data_dir = work / "window"
    reader.export_specforge(shards, data_dir)
    for marker in shards:
        store.remove(marker.shard_key)
        store.remove(marker.key)
    return data_dir


def _measure(
    target_dir: Path, data_dir: Path, params: TrainBenchParams, work: Path
) -> dict[str, Any]:
    base = TrainConfig(
        steps=params.steps,
        batch_size=params.batch_size,
        ttt_length=params.ttt_length,
        draft_vocab_size=params.draft_vocab_size,
        checkpoint_every=10**6,
        log_every=max(1, params.steps // 4),
        validation_fraction=0,  # throughput of training alone: no held-out replays
    )
    figures: dict[str, Any] = {}
    for mode in ("captured", "recompute"):
        result = train_draft(
            data_dir, target_dir, work / mode, base.model_copy(update={"features": mode})
        )
        figures[mode] = result.tokens_per_s
    return {
        "reuse_tokens_per_s": figures["captured"],
        "recompute_tokens_per_s": figures["recompute"],
        "recompute_over_reuse_time": figures["captured"] / figures["recompute"],
    }


def run_train_bench(
    config: TideConfig,
    params: TrainBenchParams,
    target_dir: Path,
    json_path: Path | None,
    *,
    preset: str = "demo",
) -> dict[str, Any]:
    build_target(target_dir, preset_name=preset)
    shapes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tide-bench-train-") as tmp:
        work = Path(tmp)
        targets = {
            "demo": target_dir,
            "llama-3.1-8b-scaled": _scaled_llama_8b(target_dir, work / "llama-3.1-8b-scaled"),
        }
        for name, path in targets.items():
            from transformers import AutoConfig  # noqa: PLC0415

            target_config = AutoConfig.from_pretrained(path)
            shape_work = work / f"run-{name}"
            data_dir = _window_from_lake(config, path, params.samples, shape_work)
            figures = _measure(path, data_dir, params, shape_work)
            figures["target"] = {
                "layers": target_config.num_hidden_layers,
                "hidden_size": target_config.hidden_size,
                "vocab_size": target_config.vocab_size,
                "random_weights": name != "demo",
            }
            shapes[name] = figures
            logger.info("train benchmark, %s target: %s", name, json.dumps(figures))
    result: dict[str, Any] = {
        **{
            key: shapes["demo"][key]
            for key in ("reuse_tokens_per_s", "recompute_tokens_per_s", "recompute_over_reuse_time")
        },
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "shapes": shapes,
        "params": params.model_dump(),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "measured_at": datetime.now(UTC).isoformat(),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result

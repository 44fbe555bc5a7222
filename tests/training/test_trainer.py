"""EAGLE3 draft training with SpecForge on CPU: learning, warm start, resume, export, validation."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.training.draft import (
    InvalidCheckpointError,
    count_output_tokens,
    load_draft,
    new_draft,
    validate_draft_dir,
)
from tide_lib.training.trainer import (
    TargetFeatures,
    TrainResult,
    evaluate_draft,
    list_samples,
    load_sample,
    remap_vocabulary,
    train_draft,
)

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

CONFIG = TrainConfig(
    steps=60,
    batch_size=4,
    ttt_length=3,
    draft_vocab_size=512,
    learning_rate=3e-3,
    checkpoint_every=20,
    log_every=10,
)


@pytest.fixture(scope="module")
def english_draft(
    tiny_target: Path, captured: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> TrainResult:
    return train_draft(captured["en_train"], tiny_target, tmp_path_factory.mktemp("en"), CONFIG)


def test_trained_draft_beats_a_random_one_on_held_out_data(
    english_draft: TrainResult, tiny_target: Path, captured: dict[str, Path]
) -> None:
    trained = evaluate_draft(english_draft.draft_dir, tiny_target, captured["en_heldout"], CONFIG)
    samples = [load_sample(p) for p in list_samples(captured["en_train"])]
    torch.manual_seed(0)  # the same random draft whichever tests ran before
    random_draft = new_draft(tiny_target, CONFIG.draft_vocab_size, count_output_tokens(samples))
    random = evaluate_draft(None, tiny_target, captured["en_heldout"], CONFIG, draft=random_draft)
    logger.info("held-out top-1 per TTT position: trained %s, random %s", trained, random)
    assert trained[0] > random[0] + 0.05
    assert trained[0] > 0.08
    assert english_draft.trained_tokens > 0 and english_draft.loss_backend == "torch"


def test_warm_start_begins_at_the_parent(
    english_draft: TrainResult, tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    untouched = train_draft(
        captured["en_train"],
        tiny_target,
        tmp_path / "zero",
        CONFIG.model_copy(update={"steps": 0, "warm_epochs": 0}),
        parent_dir=english_draft.draft_dir,
    )
    parent = load_file(english_draft.draft_dir / "model.safetensors")
    child = load_file(untouched.draft_dir / "model.safetensors")
    assert parent.keys() == child.keys()
    assert all(torch.equal(parent[key], child[key]) for key in parent)

    first_losses: dict[str, float] = {}
    for name, parent_dir in (("warm", english_draft.draft_dir), ("scratch", None)):
        train_draft(
            captured["en_train"],
            tiny_target,
            tmp_path / name,
            CONFIG.model_copy(update={"steps": 1, "log_every": 1, "warm_epochs": 0}),
            parent_dir=parent_dir,
            on_step=lambda step, metrics, name=name: first_losses.setdefault(name, metrics["loss"]),
        )
    assert first_losses["warm"] < first_losses["scratch"] - 0.5


def test_crash_and_resume_continue_from_the_last_checkpoint(
    tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    config = CONFIG.model_copy(update={"steps": 12, "checkpoint_every": 4})

    def crash(step: int, _metrics: dict[str, float]) -> None:
        if step == 6:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train_draft(captured["en_train"], tiny_target, tmp_path / "crashy", config, on_step=crash)
    resumed = train_draft(captured["en_train"], tiny_target, tmp_path / "crashy", config)
    assert resumed.resumed_from_step == 4
    straight = train_draft(captured["en_train"], tiny_target, tmp_path / "straight", config)
    assert straight.resumed_from_step is None
    a = load_file(resumed.draft_dir / "model.safetensors")
    b = load_file(straight.draft_dir / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-6), key


def test_resume_refuses_a_different_run(
    tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    config = CONFIG.model_copy(update={"steps": 2, "checkpoint_every": 1})
    train_draft(captured["en_train"], tiny_target, tmp_path, config)
    with pytest.raises(RuntimeError, match="different training run"):
        train_draft(
            captured["ko_train"], tiny_target, tmp_path, config.model_copy(update={"steps": 4})
        )


def test_export_loads_into_specforge_class_with_equal_outputs(
    english_draft: TrainResult, tiny_target: Path, captured: dict[str, Path]
) -> None:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    checkpoint = sorted((english_draft.draft_dir.parent / "checkpoints").glob("step-*.pt"))[-1]
    # The export is the best step on held-out traffic; the last checkpoint holds its weights.
    best = torch.load(checkpoint, weights_only=True)["selection"]["best"]
    assert best["step"] == english_draft.best_step
    in_memory = load_draft(english_draft.draft_dir, tiny_target)
    in_memory.load_state_dict(best["state"], strict=False)
    # SpecForge's own class, built from the exported config and weights. (Its
    # ``from_pretrained`` under transformers 5.8 leaves the non-persistent RoPE
    # buffers uninitialised, so the checkpoint is loaded into a constructed model.)
    reloaded = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(english_draft.draft_dir))
    missing, unexpected = reloaded.load_state_dict(
        load_file(english_draft.draft_dir / "model.safetensors"), strict=False
    )
    assert missing == ["embed_tokens.weight"] and not unexpected
    reloaded.embed_tokens.weight.data.copy_(in_memory.embed_tokens.weight.data)
    sample = load_sample(list_samples(captured["en_heldout"])[0])
    aux = sample["aux_hidden_state"][None].float()
    ids = sample["input_ids"][None]
    outputs = []
    for model in (in_memory.eval(), reloaded.eval()):
        with torch.no_grad():
            hidden = model.project_hidden_states(aux)
            states = model(hidden_states=aux, inputs_embeds=model.embed_input_ids(ids))
            outputs.append((hidden, model.compute_logits(states)))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
    assert torch.equal(in_memory.d2t, reloaded.d2t) and torch.equal(in_memory.t2d, reloaded.t2d)


def _broken_copy(source: Path, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    target = tmp_path / "broken"
    shutil.copytree(source, target)
    return target, load_file(target / "model.safetensors")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("drop_fc", "tensor fc.weight is missing"),
        ("nan_norm", "tensor norm.weight has non-finite values"),
        ("shape_lm_head", r"tensor lm_head.weight has shape \(3, 3\)"),
        ("architecture", "architectures is"),
        ("truncate", "cannot be read"),
        ("no_config", "has no config.json"),
        ("bad_d2t", "d2t maps draft tokens to target ids outside the vocabulary"),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_problem(
    english_draft: TrainResult, tmp_path: Path, damage: str, message: str
) -> None:
    path, state = _broken_copy(english_draft.draft_dir, tmp_path)
    weights = path / "model.safetensors"
    if damage == "drop_fc":
        del state["fc.weight"]
        save_file(state, weights)
    elif damage == "nan_norm":
        state["norm.weight"][0] = float("nan")
        save_file(state, weights)
    elif damage == "shape_lm_head":
        state["lm_head.weight"] = torch.zeros(3, 3)
        save_file(state, weights)
    elif damage == "architecture":
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["LlamaForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "no_config":
        (path / "config.json").unlink()
    elif damage == "bad_d2t":
        state["d2t"] = state["d2t"] + 7
        save_file(state, weights)
    with pytest.raises(InvalidCheckpointError, match=message):
        validate_draft_dir(path)


def test_window_vocabulary_keeps_rows_of_shared_tokens(
    english_draft: TrainResult, tiny_target: Path
) -> None:
    draft = load_draft(english_draft.draft_dir, tiny_target)
    before = draft.lm_head.weight.detach().clone()
    old_targets = (torch.arange(draft.d2t.numel()) + draft.d2t).tolist()
    # New mapping: same tokens, reversed order, so every row must move.
    new_targets = sorted(old_targets, reverse=True)
    d2t = torch.tensor(new_targets) - torch.arange(len(new_targets))
    t2d = torch.zeros_like(draft.t2d)
    t2d[new_targets] = True
    remap_vocabulary(draft, d2t, t2d)
    for new_row, token in enumerate(new_targets):
        assert torch.equal(draft.lm_head.weight[new_row], before[old_targets.index(token)])


def test_recomputed_features_equal_captured_ones(
    tiny_target: Path, captured: dict[str, Path]
) -> None:
    sample = load_sample(list_samples(captured["en_heldout"])[0])
    recomputed = TargetFeatures(tiny_target, torch.device("cpu"))(sample)
    assert torch.allclose(
        recomputed["hidden_state"].half().float(), sample["hidden_state"].float(), atol=1e-2
    )
    assert torch.allclose(
        recomputed["aux_hidden_state"].half().float(), sample["aux_hidden_state"].float(), atol=1e-2
    )


def test_metrics_reach_the_mlflow_server(
    stack: TideConfig, tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    import mlflow

    from tide_lib.training.tracking import MlflowMetricSink

    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    run = client.create_run(client.create_experiment("tide-train-test"))
    sink = MlflowMetricSink(stack.mlflow.tracking_uri, run.info.run_id)
    config = CONFIG.model_copy(update={"steps": 4, "log_every": 2})
    train_draft(captured["en_train"], tiny_target, tmp_path, config, metrics=sink)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [2, 4]
    assert {"acc_0", "acc_1", "acc_2", "lr"} <= set(client.get_run(run.info.run_id).data.metrics)


def test_torchrun_two_processes_equal_one_process_with_twice_the_batch(
    tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    """The cycle's launcher: nproc_per_node=2 runs torchrun (gloo) and trains the same draft."""
    from tide_lib.config import load_config
    from tide_lib.training.launch import TrainJob, run_training

    settings = TrainConfig(steps=3, ttt_length=2, draft_vocab_size=256, learning_rate=0.003)
    ddp = run_training(
        TrainJob(
            data_dir=captured["en_train"],
            target_dir=tiny_target,
            out_dir=tmp_path / "ddp",
            training=settings.model_copy(update={"batch_size": 2, "nproc_per_node": 2}),
        ),
        load_config(),
    )
    single = train_draft(
        captured["en_train"],
        tiny_target,
        tmp_path / "single",
        settings.model_copy(update={"batch_size": 4}),
    )
    a = load_file(ddp.draft_dir / "model.safetensors")
    b = load_file(single.draft_dir / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key


def test_a_retry_on_another_host_resumes_from_the_checkpoint_in_s3(
    stack: TideConfig, tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    """Checkpoints are mirrored to the lake bucket; a new directory (host) resumes from them."""
    import uuid

    from tide_lib.training.launch import CheckpointMirror, TrainJob, run_training

    settings = CONFIG.model_copy(update={"steps": 12, "checkpoint_every": 4})
    config = stack.model_copy(
        update={"lake": stack.lake.model_copy(update={"prefix": f"ckpt-{uuid.uuid4().hex[:6]}"})}
    )
    prefix = f"{config.lake.prefix}/_state/cycles/c1/checkpoints"
    mirror = CheckpointMirror(config, prefix, keep=2)

    def crash(step: int, _metrics: dict[str, float]) -> None:
        if step == 6:
            raise RuntimeError("trainer host lost")

    with pytest.raises(RuntimeError, match="trainer host lost"):
        train_draft(
            captured["en_train"],
            tiny_target,
            tmp_path / "host-a",
            settings,
            on_checkpoint=mirror.push,
            on_step=crash,
        )
    assert [key.rsplit("/", 1)[-1] for key in mirror.stored()] == ["step-00000004.pt"]
    other_data = shutil.copytree(captured["en_train"], tmp_path / "host-b-data")
    job = TrainJob(
        data_dir=other_data,
        target_dir=tiny_target,
        out_dir=tmp_path / "host-b",
        training=settings,
        checkpoint_prefix=prefix,
    )
    resumed = run_training(job, config)
    assert resumed.resumed_from_step == 4
    assert [key.rsplit("/", 1)[-1] for key in mirror.stored()] == [
        "step-00000008.pt",
        "step-00000012.pt",
    ]
    straight = train_draft(captured["en_train"], tiny_target, tmp_path / "straight", settings)
    a = load_file(resumed.draft_dir / "model.safetensors")
    b = load_file(straight.draft_dir / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-6), key
    mirror.clear()
    assert mirror.stored() == []


def test_a_retry_drops_a_mirrored_checkpoint_of_another_run(
    stack: TideConfig, tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    """Debris of an earlier attempt on other data must not fail every later retry."""
    import uuid

    from tide_lib.training.launch import CheckpointMirror, TrainJob, run_training

    settings = CONFIG.model_copy(update={"steps": 4, "checkpoint_every": 2})
    config = stack.model_copy(
        update={"lake": stack.lake.model_copy(update={"prefix": f"stale-{uuid.uuid4().hex[:6]}"})}
    )
    prefix = f"{config.lake.prefix}/_state/cycles/c1/checkpoints"
    mirror = CheckpointMirror(config, prefix, keep=2)
    train_draft(
        captured["ko_train"], tiny_target, tmp_path / "old", settings, on_checkpoint=mirror.push
    )
    job = TrainJob(
        data_dir=captured["en_train"],
        target_dir=tiny_target,
        out_dir=tmp_path / "retry",
        training=settings,
        checkpoint_prefix=prefix,
    )
    result = run_training(job, config)
    assert result.resumed_from_step is None
    again = run_training(job.model_copy(update={"out_dir": tmp_path / "again"}), config)
    assert again.resumed_from_step == 4  # the mirror now holds this run's checkpoints
    mirror.clear()

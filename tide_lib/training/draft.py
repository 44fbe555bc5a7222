"""EAGLE3 draft models: creation from a target, vocabulary mapping, export and validation.

The draft is SpecForge's ``LlamaForCausalLMEagle3``. Its exported form is what
SGLang loads for ``--speculative-algorithm EAGLE3``: ``config.json``
(``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors``
holding ``fc``, the decoder layer (``midlayer.*``), ``norm``, ``lm_head``, ``d2t``
and ``t2d``. The token embedding is the target's (frozen, not exported): SGLang
shares the target's embedding with the draft, and so does TIDE's engine.

Nothing downstream sees a checkpoint before :func:`validate_draft_dir` accepted it:
every expected tensor present with the right shape, every value finite, and the
vocabulary mapping consistent.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from safetensors import safe_open

from tide_lib.target.hidden import eagle_aux_layer_ids

if TYPE_CHECKING:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

__all__ = [
    "DRAFT_ARCHITECTURE",
    "InvalidCheckpointError",
    "build_vocab_mapping",
    "draft_config_for",
    "export_draft",
    "load_draft",
    "load_target_tensor",
    "new_draft",
    "validate_draft_dir",
]

logger = logging.getLogger(__name__)

DRAFT_ARCHITECTURE: Final = "LlamaForCausalLMEagle3"
WEIGHTS_FILE: Final = "model.safetensors"
CONFIG_FILE: Final = "config.json"


class InvalidCheckpointError(ValueError):
    """A draft checkpoint is missing, malformed or non-finite; the message names the tensor."""


def load_target_tensor(target_dir: Path, key: str) -> torch.Tensor:
    """One tensor of an HF checkpoint, single-file or sharded (``*.index.json``)."""
    indexes = sorted(target_dir.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        if key not in weight_map:
            raise KeyError(f"{key} is not in {indexes[0]}")
        path = target_dir / weight_map[key]
    else:
        path = target_dir / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no safetensors weights at {path}; is {target_dir} an HF model directory?"
        )
    with safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():  # noqa: SIM118  (safe_open has no __contains__)
            raise KeyError(f"{key} is not in {path}")
        tensor: torch.Tensor = handle.get_tensor(key)
        return tensor


def draft_config_for(
    target_config: Any, draft_vocab_size: int, layer_ids: list[int] | None = None
) -> Any:
    """A one-layer EAGLE3 draft config shaped after the target (SpecForge's convention)."""
    from transformers import LlamaConfig  # noqa: PLC0415

    text_config = getattr(target_config, "text_config", target_config)
    if not 0 < draft_vocab_size <= text_config.vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{text_config.vocab_size} (the target's vocabulary), "
            f"got {draft_vocab_size}"
        )
    ids = layer_ids or eagle_aux_layer_ids(text_config.num_hidden_layers)
    config = LlamaConfig(
        vocab_size=text_config.vocab_size,
        hidden_size=text_config.hidden_size,
        intermediate_size=text_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text_config.num_attention_heads,
        num_key_value_heads=text_config.num_key_value_heads,
        max_position_embeddings=text_config.max_position_embeddings,
        rms_norm_eps=text_config.rms_norm_eps,
        rope_theta=getattr(text_config, "rope_theta", 10000.0),
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    config.architectures = [DRAFT_ARCHITECTURE]
    config.draft_vocab_size = draft_vocab_size
    config.target_hidden_size = text_config.hidden_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    return config


def build_vocab_mapping(
    token_counts: Counter[int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the window's most frequent output tokens (SpecForge's rule)."""
    from specforge.data.preprocessing import process_token_dict_to_mappings  # noqa: PLC0415

    d2t, t2d = process_token_dict_to_mappings(
        Counter(token_counts), draft_vocab_size, target_vocab_size
    )
    return d2t, t2d


def count_output_tokens(samples: Iterable[dict[str, torch.Tensor]]) -> Counter[int]:
    """Frequencies of loss-bearing tokens, the input of :func:`build_vocab_mapping`."""
    counts: Counter[int] = Counter()
    for sample in samples:
        selected = sample["input_ids"].reshape(-1)[sample["loss_mask"].reshape(-1).bool()]
        ids, freqs = torch.unique(selected, return_counts=True)
        counts.update(dict(zip(ids.tolist(), freqs.tolist(), strict=True)))
    return counts


def _attach_target_embedding(draft: LlamaForCausalLMEagle3, target_dir: Path) -> None:
    embedding = load_target_tensor(target_dir, "model.embed_tokens.weight")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embedding.to(draft.embed_tokens.weight.dtype))
    draft.freeze_embedding()


def new_draft(
    target_dir: Path, draft_vocab_size: int, token_counts: Counter[int]
) -> LlamaForCausalLMEagle3:
    """A freshly initialised draft for the target; its vocabulary mapping from ``token_counts``."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    target_config = AutoConfig.from_pretrained(target_dir)
    draft = LlamaForCausalLMEagle3(draft_config_for(target_config, draft_vocab_size))
    d2t, t2d = build_vocab_mapping(token_counts, draft_vocab_size, target_config.vocab_size)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    _attach_target_embedding(draft, target_dir)
    return draft


def load_draft(draft_dir: Path, target_dir: Path) -> LlamaForCausalLMEagle3:
    """An exported (and validated) draft, with the target's embedding attached."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415

    config = validate_draft_dir(draft_dir)
    draft = LlamaForCausalLMEagle3(config)
    with safe_open(str(draft_dir / WEIGHTS_FILE), framework="pt") as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [key for key in missing if "embed" not in key]
    if missing or unexpected:
        raise InvalidCheckpointError(
            f"draft {draft_dir}: missing {missing}, unexpected {unexpected}"
        )
    _attach_target_embedding(draft, target_dir)
    return draft


def _serving_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        key: value.detach().to("cpu").contiguous()
        for key, value in draft.state_dict().items()
        if "embed" not in key.lower()
    }


def export_draft(draft: LlamaForCausalLMEagle3, out_dir: Path) -> Path:
    """Write the SGLang-loadable draft directory and validate it; returns ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir, state_dict=_serving_state(draft), safe_serialization=True)
    validate_draft_dir(out_dir)
    logger.info("exported EAGLE3 draft to %s", out_dir)
    return out_dir


def _expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415

    with torch.device("meta"):
        skeleton = LlamaForCausalLMEagle3(config)
    return {
        key: tuple(value.shape)
        for key, value in skeleton.state_dict().items()
        if "embed" not in key.lower()
    }


def validate_draft_dir(draft_dir: Path) -> Any:
    """Check an exported draft; returns its config, raises :class:`InvalidCheckpointError`."""
    from transformers import LlamaConfig  # noqa: PLC0415

    config_path, weights_path = draft_dir / CONFIG_FILE, draft_dir / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise InvalidCheckpointError(f"draft checkpoint {draft_dir} has no {path.name}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidCheckpointError(f"{config_path} is not valid JSON: {error}") from error
    if raw.get("architectures") != [DRAFT_ARCHITECTURE]:
        raise InvalidCheckpointError(
            f"{config_path}: architectures is {raw.get('architectures')}, "
            f"expected [{DRAFT_ARCHITECTURE}]"
        )
    for field in ("draft_vocab_size", "eagle_config"):
        if field not in raw:
            raise InvalidCheckpointError(f"{config_path} has no {field}")
    layer_ids = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(layer_ids, list) and len(layer_ids) == 3):
        raise InvalidCheckpointError(
            f"{config_path}: eagle_aux_hidden_state_layer_ids must list 3 layers"
        )
    config = LlamaConfig.from_pretrained(draft_dir)
    expected = _expected_shapes(config)
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            present = set(handle.keys())
            for key, shape in expected.items():
                if key not in present:
                    raise InvalidCheckpointError(f"{weights_path}: tensor {key} is missing")
                tensor = handle.get_tensor(key)
                if tuple(tensor.shape) != shape:
                    raise InvalidCheckpointError(
                        f"{weights_path}: tensor {key} has shape {tuple(tensor.shape)}, "
                        f"expected {shape}"
                    )
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise InvalidCheckpointError(
                        f"{weights_path}: tensor {key} has non-finite values"
                    )
            d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    except InvalidCheckpointError:
        raise
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise InvalidCheckpointError(f"{weights_path} cannot be read: {error}") from error
    if int(t2d.sum()) != config.draft_vocab_size:
        raise InvalidCheckpointError(
            f"{weights_path}: t2d selects {int(t2d.sum())} tokens, "
            f"draft_vocab_size is {config.draft_vocab_size}"
        )
    targets = torch.arange(d2t.numel()) + d2t
    if int(targets.max()) >= t2d.numel() or not bool(t2d[targets].all()):
        raise InvalidCheckpointError(
            f"{weights_path}: d2t points at tokens that t2d does not select"
        )
    return config

"""EAGLE3 draft models: creation from a target, vocabulary mapping, export and validation.

The draft is SpecForge's ``LlamaForCausalLMEagle3``. Its exported form is what
SGLang loads for ``--speculative-algorithm EAGLE3``: ``config.json``
(``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors``
holding ``fc``, the decoder layer (``midlayer.*``), ``norm``, ``lm_head``, ``d2t``
and ``t2d``. The token embedding is the target's (frozen, not exported): SGLang
shares the target's embedding with the draft, and so does TIDE's engine.

Nothing downstream sees a checkpoint before :func:`validate_draft_dir` accepted it:
config fields typed and consistent, every expected tensor present with the right
shape and dtype, every value finite, and the vocabulary mapping in range and
consistent. Servers also pass a :class:`DraftTarget`, so a draft of another target
is refused before it is loaded; the reference engine and TIDE's SGLang plugin use
this one check, so a checkpoint one accepts the other accepts too.
"""

from __future__ import annotations

__all__ = [
    "DRAFT_ARCHITECTURE",
    "DraftTarget",
    "InvalidCheckpointError",
    "TargetHead",
    "build_vocab_mapping",
    "check_vocab_mapping",
    "draft_config_for",
    "draft_tokens",
    "export_draft",
    "load_draft",
    "load_target_tensor",
    "new_draft",
    "validate_draft_dir",
]

import contextlib
import dataclasses
import io
import json
import logging
from collections import Counter
from collections.abc import Iterable
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from safetensors import safe_open

from tide_lib.errors import TideError
from tide_lib.target_model.hidden import eagle_aux_layer_ids

if TYPE_CHECKING:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

logger = logging.getLogger(__name__)

DRAFT_ARCHITECTURE: Final = "LlamaForCausalLMEagle3"
WEIGHTS_FILE: Final = "model.safetensors"
CONFIG_FILE: Final = "config.json"


class InvalidCheckpointError(TideError, ValueError):
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


_KEPT_TOKEN_PRIOR = 0.5  # below any token the mix holds, above SpecForge's zero-count filler


def build_vocab_mapping(
    token_counts: Counter[int],
    draft_vocab_size: int,
    target_vocab_size: int,
    keep: Iterable[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the mix's most frequent output tokens (SpecForge's rule).

    ``keep`` (a warm start: the parent's tokens) fills the places the mix leaves
    free: SpecForge would fill them with the lowest token ids, throwing away trained
    rows of tokens that only missed this cycle's small mix.
    """
    from specforge.data.preprocessing import process_token_dict_to_mappings  # noqa: PLC0415

    counts: Counter[int] = Counter(token_counts)
    for token in keep:
        counts.setdefault(int(token), _KEPT_TOKEN_PRIOR)  # type: ignore[arg-type]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab_size, target_vocab_size)
    return d2t, t2d


def draft_tokens(d2t: torch.Tensor) -> torch.Tensor:
    """The target token id of each draft token (``d2t`` stores offsets), on its device."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)


def count_output_tokens(
    samples: Iterable[dict[str, torch.Tensor]], weights: Iterable[int] | None = None
) -> Counter[int]:
    """Frequencies of loss-bearing tokens, the input of :func:`build_vocab_mapping`.

    ``weights``: how many times each sample counts (how often training draws it);
    default once each.
    """
    counts: Counter[int] = Counter()
    for sample, weight in zip(samples, weights if weights is not None else repeat(1), strict=False):
        if weight <= 0:
            continue
        selected = sample["input_ids"].reshape(-1)[sample["loss_mask"].reshape(-1).bool()]
        ids, freqs = torch.unique(selected, return_counts=True)
        counts.update(dict(zip(ids.tolist(), (freqs * weight).tolist(), strict=True)))
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


def load_draft(
    draft_dir: Path, target_dir: Path, target: DraftTarget | None = None
) -> LlamaForCausalLMEagle3:
    """An exported draft, validated (against ``target`` when given), the target's embedding on."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415

    config = validate_draft_dir(draft_dir, target)
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


@dataclasses.dataclass(frozen=True)
class DraftTarget:
    """What a draft must fit: the serving target's shape (checked when known)."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int | None = None

    @classmethod
    def of(cls, target_config: Any) -> DraftTarget:
        """From an HF target config (``text_config`` of a multimodal one)."""
        text = getattr(target_config, "text_config", target_config)
        layers = getattr(text, "num_hidden_layers", None)
        return cls(int(text.hidden_size), int(text.vocab_size), layers)


_FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES: Final = (torch.int64, torch.int32)
_POSITIVE_INTS: Final = (
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidCheckpointError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise InvalidCheckpointError(f"{config_path} must hold a JSON object")
    if raw.get("architectures") != [DRAFT_ARCHITECTURE]:
        raise InvalidCheckpointError(
            f"{config_path}: architectures is {raw.get('architectures')}, "
            f"expected [{DRAFT_ARCHITECTURE}]"
        )
    for field in ("draft_vocab_size", *_POSITIVE_INTS):
        if not (_is_int(raw.get(field)) and raw[field] > 0):
            raise InvalidCheckpointError(f"{config_path}: {field} must be a positive integer")
    if raw["draft_vocab_size"] > raw["vocab_size"]:
        raise InvalidCheckpointError(
            f"{config_path}: draft_vocab_size {raw['draft_vocab_size']} exceeds vocab_size "
            f"{raw['vocab_size']}"
        )
    return raw


def _check_eagle_config(config_path: Path, raw: dict[str, Any], target: DraftTarget | None) -> None:
    eagle = raw.get("eagle_config")
    if not isinstance(eagle, dict):
        raise InvalidCheckpointError(f"{config_path}: eagle_config must be a JSON object")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not (isinstance(ids, list) and len(ids) == 3 and all(_is_int(i) and i >= 0 for i in ids)):
        raise InvalidCheckpointError(f"{config_path}: {field} must list 3 layers (integers >= 0)")
    layers = target.num_hidden_layers if target is not None else None
    if layers is not None and max(ids) > layers - 2:
        raise InvalidCheckpointError(
            f"{config_path}: {field} {ids} name layers this target lacks (it has {layers}; "
            f"ids must be at most {layers - 2})"
        )
    if not isinstance(eagle.get("use_aux_hidden_state", True), bool):
        raise InvalidCheckpointError(f"{config_path}: eagle_config.use_aux_hidden_state is no bool")


def _check_fits_target(config_path: Path, raw: dict[str, Any], target: DraftTarget) -> None:
    fits = {
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    for field, wanted in fits.items():
        value = raw.get(field, wanted)
        if value != wanted:
            raise InvalidCheckpointError(
                f"{config_path}: {field} is {value}, this target needs {wanted}: the draft was "
                "trained for another target"
            )


def _expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415

    try:
        with torch.device("meta"):
            skeleton = LlamaForCausalLMEagle3(config)
    except Exception as error:  # inconsistent sizes (heads not dividing hidden, ...)
        raise InvalidCheckpointError(f"the draft's config.json is inconsistent: {error}") from error
    return {
        key: tuple(value.shape)
        for key, value in skeleton.state_dict().items()
        if "embed" not in key.lower()
    }


def _check_tensor(
    weights_path: Path, key: str, tensor: torch.Tensor, shape: tuple[int, ...]
) -> None:
    if tuple(tensor.shape) != shape:
        raise InvalidCheckpointError(
            f"{weights_path}: tensor {key} has shape {tuple(tensor.shape)}, expected {shape}"
        )
    wanted = {"d2t": _INDEX_DTYPES, "t2d": (torch.bool,)}.get(key, _FLOAT_DTYPES)
    if tensor.dtype not in wanted:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in wanted)
        raise InvalidCheckpointError(
            f"{weights_path}: tensor {key} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
            f"expected {names}"
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise InvalidCheckpointError(f"{weights_path}: tensor {key} has non-finite values")


def _read_tensors(
    weights_path: Path, expected: dict[str, tuple[int, ...]]
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            present = set(handle.keys())
            _refuse_unknown(weights_path, present - set(expected))
            for key, shape in expected.items():
                if key not in present:
                    raise InvalidCheckpointError(f"{weights_path}: tensor {key} is missing")
                _check_tensor(weights_path, key, handle.get_tensor(key), shape)
            return handle.get_tensor("d2t"), handle.get_tensor("t2d")
    except InvalidCheckpointError:
        raise
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise InvalidCheckpointError(f"{weights_path} cannot be read: {error}") from error


def _refuse_unknown(weights_path: Path, unknown: set[str]) -> None:
    """An exported draft holds its own tensors and no more: SGLang's EAGLE3 loader skips
    names it does not know silently, and the token embedding is the target's."""
    if not unknown:
        return
    embedding = sorted(key for key in unknown if "embed" in key.lower())
    if embedding:
        raise InvalidCheckpointError(
            f"{weights_path}: tensor {embedding[0]} is a token embedding; a draft uses the "
            "target's and must not carry one (export it with tide's exporter)"
        )
    names = ", ".join(sorted(unknown)[:5])
    raise InvalidCheckpointError(
        f"{weights_path}: tensors {names} are not part of an EAGLE3 draft of this config "
        "(SGLang would skip them silently)"
    )


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int) -> None:
    """``d2t`` maps each draft token to a distinct target token that ``t2d`` selects."""
    if int(t2d.sum()) != draft_vocab_size:
        raise InvalidCheckpointError(
            f"t2d selects {int(t2d.sum())} tokens, draft_vocab_size is {draft_vocab_size}"
        )
    targets = draft_tokens(d2t)
    if int(targets.min()) < 0 or int(targets.max()) >= t2d.numel():
        raise InvalidCheckpointError(
            f"d2t maps draft tokens to target ids outside the vocabulary [0, {t2d.numel()})"
        )
    if not bool(t2d[targets].all()) or int(torch.unique(targets).numel()) != targets.numel():
        raise InvalidCheckpointError(
            "d2t maps draft tokens to target ids that t2d does not select, or to one id twice"
        )


def validate_draft_dir(draft_dir: Path, target: DraftTarget | None = None) -> Any:
    """Check an exported draft completely; returns its config.

    Files present; ``config.json`` fields typed and consistent (and fitting ``target``
    when given); every tensor present with its shape and dtype, finite; ``d2t`` and
    ``t2d`` in range and consistent. Raises :class:`InvalidCheckpointError` naming the
    field. The one check every consumer of a checkpoint uses (export, registry,
    reference engine, SGLang plugin).
    """
    from transformers import LlamaConfig  # noqa: PLC0415

    config_path, weights_path = draft_dir / CONFIG_FILE, draft_dir / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise InvalidCheckpointError(f"draft checkpoint {draft_dir} has no {path.name}")
    raw = _read_config(config_path)
    _check_eagle_config(config_path, raw, target)
    if target is not None:
        _check_fits_target(config_path, raw, target)
    try:
        config = LlamaConfig.from_pretrained(draft_dir)
    except Exception as error:  # transformers raises many types for odd field values
        raise InvalidCheckpointError(f"{config_path} is not a Llama config: {error}") from error
    d2t, t2d = _read_tensors(weights_path, _expected_shapes(config))
    try:
        check_vocab_mapping(d2t, t2d, config.draft_vocab_size)
    except InvalidCheckpointError as error:
        raise InvalidCheckpointError(f"{weights_path}: {error}") from error
    return config


class TargetHead(torch.nn.Module):
    """The target's frozen ``lm_head`` with SpecForge's ``TargetHead`` interface."""

    def __init__(self, target_dir: Path) -> None:
        super().__init__()
        from transformers import AutoConfig  # noqa: PLC0415

        config = AutoConfig.from_pretrained(target_dir)
        key = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        weight = load_target_tensor(target_dir, key).float()
        self.fc = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(weight)
        self.fc.weight.requires_grad_(False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.fc(hidden.to(self.fc.weight.dtype))
        return logits

    def preprocess(
        self, input_ids: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from specforge.modeling.target.target_head import TargetHead  # noqa: PLC0415

        result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = TargetHead.preprocess(
            self, input_ids, target, loss_mask
        )
        return result

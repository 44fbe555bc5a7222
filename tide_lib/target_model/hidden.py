"""The target's hidden states exactly as SGLang hands them to an EAGLE3 draft.

SGLang captures, for EAGLE3, the *input* of decoder layers ``id + 1`` for the
configured ``eagle_aux_hidden_state_layer_ids`` (that is, the output of layers
``id``), concatenated into ``[T, 3H]``, and the final state that feeds
``lm_head`` (after the final norm). Forward hooks on the decoder layers and the
final norm read the same tensors from an HF ``transformers`` model, without
keeping every layer's output as ``output_hidden_states`` would.
"""

from __future__ import annotations

__all__ = ["HiddenStateCapture", "eagle_aux_layer_ids"]

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MIN_LAYERS = 4


def eagle_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang/SpecForge's default ``[1, N//2 - 1, N - 4]``, kept distinct for shallow models.

    For N >= 8 this is exactly the default (Llama-3.1-8B: [1, 15, 28]). Shallow demo
    targets would repeat a layer (N = 6 gives [1, 2, 2]); there each id is nudged
    above the previous one, keeping the low/middle/high spread (N = 6 gives [1, 2, 3]).
    Ids stay <= N - 2: SGLang captures the *input* of layer ``id + 1``.
    """
    if num_layers < MIN_LAYERS:
        raise ValueError(
            f"EAGLE3 needs a target with at least {MIN_LAYERS} layers, got {num_layers}"
        )
    top = num_layers - 2
    low = min(1, top - 2)
    mid = max(low + 1, min(num_layers // 2 - 1, top - 1))
    high = min(top, max(mid + 1, num_layers - 4))
    return [low, mid, high]


def _decoder(model: Any) -> Any:
    """The decoder stack of a causal LM (``model.model`` for Llama-style models)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise TypeError(
            f"{type(model).__name__} has no .model.layers / .model.norm; "
            "hidden-state capture supports Llama-style decoder models"
        )
    return inner


def _first_tensor(output: Any) -> torch.Tensor:
    tensor: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return tensor


class HiddenStateCapture:
    """Collects final and aux states of every forward pass run inside :meth:`capturing`.

    Each forward appends ``[B, t, H]`` and ``[B, t, 3H]`` chunks (prefill, then one
    chunk per decode step); :meth:`take` concatenates them along the sequence.
    """

    def __init__(self, model: Any, layer_ids: list[int] | None = None) -> None:
        decoder = _decoder(model)
        self.layer_ids = layer_ids or eagle_aux_layer_ids(len(decoder.layers))
        last = len(decoder.layers) - 2
        if len(self.layer_ids) != 3 or not 0 <= min(self.layer_ids) <= max(self.layer_ids) <= last:
            raise ValueError(
                f"aux layer ids {self.layer_ids} must be three layers in 0..{last} of a "
                f"{len(decoder.layers)}-layer target (SGLang reads the input of layer id + 1)"
            )
        self._decoder = decoder
        self._aux: dict[int, list[torch.Tensor]] = {i: [] for i in self.layer_ids}
        self._final: list[torch.Tensor] = []

    @contextlib.contextmanager
    def capturing(self) -> Iterator[HiddenStateCapture]:
        handles = [
            self._decoder.layers[i].register_forward_hook(
                lambda _m, _inp, out, i=i: self._aux[i].append(_first_tensor(out).detach())
            )
            for i in self.layer_ids
        ]
        handles.append(
            self._decoder.norm.register_forward_hook(
                lambda _m, _inp, out: self._final.append(_first_tensor(out).detach())
            )
        )
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(final [B, T, H], aux [B, T, 3H])`` of everything captured so far; then resets."""
        if not self._final:
            raise RuntimeError("no forward pass was captured")
        final = torch.cat(self._final, dim=1)
        aux = torch.cat([torch.cat(self._aux[i], dim=1) for i in self.layer_ids], dim=-1)
        self._final.clear()
        for chunks in self._aux.values():
            chunks.clear()
        return final, aux


def capture_records(
    model: Any,
    tokenizer: Any,
    documents: Any,
    *,
    target_id: str,
    draft_version: str = "",
) -> Iterator[Any]:
    """Teacher-forced captures of whole documents, as serving would hand them to the lake.

    Used to seed drafts and benchmarks from text when there is no traffic yet;
    live traffic is captured by the engine while it decodes.
    """
    from datetime import UTC, datetime  # noqa: PLC0415

    from tide_lib.lake.schema import CapturedRecord  # noqa: PLC0415
    from tide_lib.target_model.build import encode_document  # noqa: PLC0415

    capture = HiddenStateCapture(model)
    for index, document in enumerate(documents):
        ids, mask = encode_document(tokenizer, document)
        started = datetime.now(UTC)
        with torch.no_grad(), capture.capturing():
            model(input_ids=torch.tensor([ids]))
        final, aux = capture.take()
        yield CapturedRecord.of_forward(
            f"{document.domain}-{index}",
            started,
            (ids, mask),
            (final[0], aux[0]),
            target_id=target_id,
            draft_version=draft_version,
            completion_tokens=int(sum(mask)),
        )

"""Hidden-state capture equals what SGLang hands an EAGLE3 draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tide_lib.target_model import HiddenStateCapture, eagle_aux_layer_ids


def test_default_layers_match_sglang_for_real_depths() -> None:
    assert eagle_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert eagle_aux_layer_ids(36) == [1, 17, 32]  # gpt-oss-120b
    assert eagle_aux_layer_ids(8) == [1, 3, 4]
    assert eagle_aux_layer_ids(6) == [1, 2, 3]  # shallow demo target: kept distinct
    assert eagle_aux_layer_ids(4) == [0, 1, 2]  # never the last layer (SGLang reads layer id+1)
    with pytest.raises(ValueError, match="at least 4 layers"):
        eagle_aux_layer_ids(3)


@pytest.mark.slow
def test_capture_matches_hf_hidden_states(tiny_target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    capture = HiddenStateCapture(model)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    with torch.no_grad(), capture.capturing():
        output = model(input_ids=ids, output_hidden_states=True)
    final, aux = capture.take()
    hidden = model.config.hidden_size
    assert torch.allclose(model.lm_head(final), output.logits, atol=1e-5)  # final = lm_head input
    for slot, layer in enumerate(capture.layer_ids):  # aux = output of layer id
        assert torch.equal(
            aux[..., slot * hidden : (slot + 1) * hidden], output.hidden_states[layer + 1]
        )


@pytest.mark.slow
def test_capture_across_kv_cache_decode_equals_one_forward(tiny_target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    capture = HiddenStateCapture(model)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    with torch.no_grad(), capture.capturing():
        model(input_ids=ids)
    full_final, full_aux = capture.take()
    with torch.no_grad(), capture.capturing():
        out = model(input_ids=ids[:, :4], use_cache=True)
        cache = out.past_key_values
        for position in range(4, ids.shape[1]):
            out = model(
                input_ids=ids[:, position : position + 1], past_key_values=cache, use_cache=True
            )
            cache = out.past_key_values
    step_final, step_aux = capture.take()
    assert torch.allclose(step_final, full_final, atol=1e-5)
    assert torch.allclose(step_aux, full_aux, atol=1e-5)

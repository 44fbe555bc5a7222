"""The verify's logits computed from the captured final states equal the HF forward's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tide_lib.serving.speculative import SpeculativeDecoder


def _target(**extra: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        **extra,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_head_logits_equal_the_full_forward_for_every_verified_row(tied: bool) -> None:
    target = _target(tie_word_embeddings=tied)
    decoder = SpeculativeDecoder(target, None, 3, None)
    prompt = list(range(3, 20))
    _, cache, _, _ = decoder._target_forward(prompt, None)
    verify = [21, 22, 23, 24]
    logits, _, _, _ = decoder._target_forward(verify, cache)
    with torch.no_grad():
        reference = target(input_ids=torch.tensor([prompt + verify])).logits[0, -len(verify) :]
    assert logits.shape == reference.shape
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_a_head_that_scales_its_logits_keeps_the_full_forward() -> None:
    target = _target()
    target.config.logits_scaling = 4.0  # as Granite's config says
    assert SpeculativeDecoder(target, None, 3, None)._head is None
    assert SpeculativeDecoder(_target(), None, 3, None)._head is not None

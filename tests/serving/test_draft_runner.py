"""The draft's incremental inference equals SpecForge's own layer on the same positions.

:class:`~tide_lib.serving.speculative.DraftRunner` re-implements one step of the
EAGLE3 layer with a KV cache (for speed); a slip in its positions, mask or cache
would not change a greedy output (the target verifies every token) but would
quietly lower acceptance. These tests hold it to SpecForge's forward pass.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from tide_lib.serving.speculative import DraftRunner
from tide_lib.training.draft import draft_config_for

POSITIONS = 90  # past the runner's first cache capacity (64): the cache grows once


def target_config() -> LlamaConfig:
    """A tiny target's config (its drafts here have a vocabulary of 128)."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query heads, read in place by the runner
    )


def _draft() -> torch.nn.Module:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    torch.manual_seed(0)
    return LlamaForCausalLMEagle3(draft_config_for(target_config(), 128)).eval()


def _specforge_layer(
    draft: torch.nn.Module, tokens: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """SpecForge's layer over all positions at once, causally masked (its first TTT step)."""
    count = int(tokens.shape[0])
    mask = torch.full((count, count), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out: torch.Tensor = draft.midlayer(
            input_emb=draft.embed_input_ids(tokens[None]),
            hidden_states=hidden[None],
            cache_hidden=[[], []],
            attention_mask=mask,
            position_ids=torch.arange(count)[None],
        )
    return out[0]


def test_steps_of_any_size_equal_specforge_over_all_positions() -> None:
    draft = _draft()
    tokens = torch.randint(0, 256, (POSITIONS,), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(POSITIONS, 64, generator=torch.Generator().manual_seed(2))
    reference = _specforge_layer(draft, tokens, hidden)
    runner = DraftRunner(draft)
    rows, logits = [], None
    start = 0
    for size in [7, 1, 3, 1, 1, 4, 2, 1] * 20:
        end = min(start + size, POSITIONS)
        if end == start:
            break
        out, logits = runner.step(tokens[start:end], hidden[start:end])
        rows.append(out)
        start = end
    torch.testing.assert_close(torch.cat(rows), reference, rtol=1e-4, atol=1e-4)
    assert logits is not None and logits.shape == (128,)  # the last position's alone
    with torch.no_grad():
        expected = draft.compute_logits(reference[-1])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_crop_forgets_the_rejected_positions() -> None:
    """After a crop, positions written again read the new rows, not the rejected ones."""
    draft = _draft()
    tokens = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(70, 64, generator=torch.Generator().manual_seed(4))
    runner = DraftRunner(draft)
    runner.step(tokens[:60], hidden[:60])
    runner.step(torch.tensor([5, 6, 7]), torch.randn(3, 64))  # drafted, then rejected
    runner.crop(60)
    assert runner.length == 60
    out, _ = runner.step(tokens[60:], hidden[60:])
    torch.testing.assert_close(
        out, _specforge_layer(draft, tokens, hidden)[60:], rtol=1e-4, atol=1e-4
    )
    runner.reset()
    assert runner.length == 0
    again, _ = runner.step(tokens[:5], hidden[:5])
    torch.testing.assert_close(
        again, _specforge_layer(draft, tokens[:5], hidden[:5]), rtol=1e-4, atol=1e-4
    )


def test_a_draft_moved_to_another_dtype_gets_a_cache_of_that_dtype() -> None:
    """The cache buffer follows the draft (a draft cast or moved between requests)."""
    draft = _draft()
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    runner = DraftRunner(draft)
    runner.step(tokens, hidden)
    draft.double()
    runner.reset()
    out, _ = runner.step(tokens[:8], hidden[:8].double())
    more, _ = runner.step(tokens[8:], hidden[8:].double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(
        torch.cat((out, more)), _specforge_layer(draft, tokens, hidden.double())
    )

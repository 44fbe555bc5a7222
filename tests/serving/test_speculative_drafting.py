"""The chain draft stops at a drafted end of output: tokens after it would never be emitted."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaForCausalLM

from tests.serving.test_draft_runner import target_config
from tide_lib.serving.speculative import SpeculativeDecoder
from tide_lib.training.draft import draft_config_for


def _models() -> tuple[LlamaForCausalLM, torch.nn.Module]:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    torch.manual_seed(0)
    config = target_config()
    return LlamaForCausalLM(config).eval(), LlamaForCausalLMEagle3(draft_config_for(config, 128))


def _verified(decoder: SpeculativeDecoder, prompt: list[int], tokens: int) -> list[list[int]]:
    """The token ids of every verify forward of one greedy request."""
    seen: list[list[int]] = []
    forward = decoder._timed_forward

    def spy(ids: list[int], cache: Any, timings: Any) -> Any:
        seen.append(list(ids))
        return forward(ids, cache, timings)

    decoder._timed_forward = spy  # type: ignore[method-assign]
    decoder.generate(prompt, tokens)
    return seen


def test_a_drafted_end_of_output_is_the_last_token_drafted_and_verified() -> None:
    target, draft = _models()
    prompt = list(range(3, 24))
    free = _verified(SpeculativeDecoder(target, draft, 4, None), prompt, 12)
    # An end token the draft proposes in some round before its last draft, never as the
    # target's own token (the verify's first; that would end the request there)
    own = {verify[0] for verify in free}
    end = next(t for verify in free for t in verify[1:-1] if t not in own)
    ended = _verified(SpeculativeDecoder(target, draft, 4, end), prompt, 12)
    cut = [verify for verify in ended if verify[-1] == end and len(verify) < 5]
    assert cut  # a round that drafted the end drafted nothing after it
    for verify in ended:
        assert end not in verify[1:-1]  # never a drafted token after a drafted end
    with_end = SpeculativeDecoder(target, draft, 4, end).generate(prompt, 12)
    plain = SpeculativeDecoder(target, None, 4, end).generate(prompt, 12, speculative=False)
    assert with_end.output_ids == plain.output_ids  # still exactly greedy decoding


def test_a_probe_speculates_its_first_rounds_and_decodes_the_rest_plainly() -> None:
    """Exactly greedy decoding still; its timings hold the probe's rounds alone, marked a
    probe (what its k delivers is not measured); a request that ends within them is no
    probe: all of it was served at its k."""
    target, draft = _models()
    prompt = list(range(3, 24))
    decoder = SpeculativeDecoder(target, draft, 3, None)
    plain = decoder.generate(prompt, 20, speculative=False)
    probe = decoder.generate(prompt, 20, probe_rounds=2)
    assert probe.output_ids == plain.output_ids
    assert probe.verify_steps == len(probe.timings.rounds) == 2
    assert probe.timings.probe and probe.timings.k == 3
    assert 2 <= probe.timings.emitted <= 2 * 4 < len(probe.output_ids)
    assert len(probe.timings.target_forwards) == 2  # the plain rest is not measured
    # what capture stores: every position's states, as plain decoding has them
    assert probe.final_states.shape == plain.final_states.shape
    assert torch.allclose(probe.aux_states, plain.aux_states, atol=1e-4)
    whole = decoder.generate(prompt, 3, probe_rounds=8)
    assert not whole.timings.probe and whole.output_ids == plain.output_ids[:3]

"""EAGLE3 chain speculative decoding over an HF target, with the states serving captures.

One request at a time (the engine's worker serialises them): the target keeps an
HF KV cache, the draft a KV cache of its single layer. Each round the draft
proposes ``k`` tokens from the target's aux features, the target verifies them
in one forward, and the accepted prefix plus one target token (the bonus) is
emitted. Greedy requests accept while the draft equals the target's argmax, so
the output is exactly plain greedy decoding. Sampled requests use the standard
speculative rejection rule (accept with ``min(1, p/q)``, else resample from
``max(0, p - q)``), so outputs follow the target's distribution.

Draft positions follow SpecForge's training: at prefix position ``i`` the draft
reads ``embed(x[i+1])`` and ``fc(aux[i])``; later draft steps read the previous
draft step's hidden output instead of target features, at the next position.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime
from typing import Any

import torch

from tide_lib.lake.reader import TrainingSample
from tide_lib.target.hidden import HiddenStateCapture

__all__ = ["MIN_TEMPERATURE", "DraftRunner", "Generation", "SpeculativeDecoder"]


@dataclasses.dataclass
class Generation:
    """What one request produced, with the target states of every token the target read."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    verify_steps: int
    accepted_draft_tokens: int
    drafted_tokens: int
    final_states: torch.Tensor  # [T, H], T = prompt + output tokens the target has read
    aux_states: torch.Tensor  # [T, 3H]

    def training_sample(self, request_id: str, draft_version: str = "") -> TrainingSample:
        """The tokens the target read, their loss mask (1 on output) and float16 states."""
        length = int(self.final_states.shape[0])
        prompt = len(self.prompt_ids)
        return TrainingSample(
            request_id=request_id,
            draft_version=draft_version,
            finished_at=datetime.now(UTC),
            input_ids=torch.tensor((self.prompt_ids + self.output_ids)[:length]),
            loss_mask=torch.tensor([0] * prompt + [1] * (length - prompt)),
            hidden_state=self.final_states.to(torch.float16),
            aux_hidden_state=self.aux_states.to(torch.float16),
            spec_verify_ct=self.verify_steps,
            spec_accept_tokens=self.accepted_draft_tokens,
        )

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, bonus included (SGLang's definition)."""
        if not self.verify_steps:
            return 0.0
        return (self.accepted_draft_tokens + self.verify_steps) / self.verify_steps


class DraftRunner:
    """Incremental inference of SpecForge's ``LlamaForCausalLMEagle3`` with a KV cache."""

    def __init__(self, draft: Any) -> None:
        self.draft = draft.eval()
        layer = draft.midlayer
        self.attn = layer.self_attn
        self.keys: torch.Tensor | None = None  # [1, heads, L, head_dim] after repeat_kv
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def reset(self) -> None:
        self.keys = self.values = None

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        projected: torch.Tensor = self.draft.project_hidden_states(aux)
        return projected

    @torch.no_grad()
    def step(
        self, token_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append positions for ``token_ids`` [q] with input states ``hidden`` [q, H].

        Returns the layer outputs [q, H] (the next step's input state) and the draft
        logits [q, draft_vocab] of the token after each position.
        """
        from specforge.modeling.draft.llama3_eagle import (  # noqa: PLC0415
            apply_rotary_pos_emb,
            repeat_kv,
        )

        layer, attn = self.draft.midlayer, self.attn
        start, count = self.length, int(token_ids.shape[0])
        embeds = self.draft.embed_input_ids(token_ids[None]).to(hidden.dtype)
        residual = hidden[None]
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(residual)), dim=-1)
        heads, kv_heads, dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        q = attn.q_proj(x).view(1, count, heads, dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, count, kv_heads, dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, count, kv_heads, dim).transpose(1, 2)
        positions = torch.arange(start, start + count)
        cos, sin = attn.rotary_emb(q, seq_len=start + count)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, positions[None])
        k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        self.keys = k if self.keys is None else torch.cat((self.keys, k), dim=2)
        self.values = v if self.values is None else torch.cat((self.values, v), dim=2)
        mask = torch.arange(start + count)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=mask
        )
        out = attn.o_proj(out.transpose(1, 2).reshape(1, count, heads * dim))
        hidden_out = residual + out
        hidden_out = hidden_out + layer.mlp(layer.post_attention_layernorm(hidden_out))
        logits = self.draft.compute_logits(hidden_out)
        return hidden_out[0], logits[0]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        mapped: torch.Tensor = draft_ids + self.draft.d2t[draft_ids]
        return mapped


# Below this, sampling is greedy (as in SGLang): dividing by it would overflow the softmax.
MIN_TEMPERATURE = 1e-5


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


class SpeculativeDecoder:
    """Generates for one request with a target, an optional draft and ``k`` draft steps."""

    def __init__(
        self, target: Any, draft: Any | None, num_steps: int, eos_token_id: int | None
    ) -> None:
        self.target = target.eval()
        self.capture = HiddenStateCapture(target, self._layer_ids(draft))
        self.runner = DraftRunner(draft) if draft is not None else None
        self.num_steps = num_steps
        self.eos_token_id = eos_token_id

    @staticmethod
    def _layer_ids(draft: Any | None) -> list[int] | None:
        if draft is None:
            return None
        ids: list[int] = list(draft.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        return ids

    def _target_forward(
        self, ids: list[int], cache: Any
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        with self.capture.capturing():
            out = self.target(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        final, aux = self.capture.take()
        return out.logits[0], out.past_key_values, final[0], aux[0]

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        speculative: bool = True,
        generator: torch.Generator | None = None,
        ignore_eos: bool = False,
    ) -> Generation:
        greedy = temperature < MIN_TEMPERATURE
        eos = None if ignore_eos else self.eos_token_id

        def sample(logits: torch.Tensor) -> int:
            if greedy:
                return int(logits.argmax())
            return int(torch.multinomial(_probs(logits, temperature), 1, generator=generator))

        logits, cache, finals, auxes = self._target_forward(prompt_ids, None)
        final_chunks, aux_chunks = [finals], [auxes]
        output = [sample(logits[-1])]
        position = len(prompt_ids)  # position of output[-1], not yet read by the target
        verify_steps = accepted_total = drafted_total = 0
        use_draft = speculative and self.runner is not None
        if use_draft:
            assert self.runner is not None
            self.runner.reset()
            tokens = torch.tensor(prompt_ids[1:] + output[-1:])
            hidden, draft_logits = self.runner.step(tokens, self.runner.project(auxes))
        while len(output) < max_new_tokens and output[-1] != eos:
            if not use_draft:
                logits, cache, finals, auxes = self._target_forward(output[-1:], cache)
                final_chunks.append(finals)
                aux_chunks.append(auxes)
                output.append(sample(logits[-1]))
                position += 1
                continue
            assert self.runner is not None
            # Draft k tokens (chain).
            drafted: list[int] = []
            draft_probs: list[torch.Tensor] = []
            last_hidden, last_logits = hidden[-1:], draft_logits[-1]
            budget = min(self.num_steps, max_new_tokens - len(output))
            for step in range(budget):
                if greedy:
                    draft_id = int(last_logits.argmax())
                else:
                    probs = _probs(last_logits, temperature)
                    draft_id = int(torch.multinomial(probs, 1, generator=generator))
                    draft_probs.append(probs)
                token = int(self.runner.to_target_ids(torch.tensor(draft_id)))
                drafted.append(token)
                if step + 1 < budget:
                    last_hidden, step_logits = self.runner.step(torch.tensor([token]), last_hidden)
                    last_logits = step_logits[-1]
            # Verify in one target forward.
            logits, cache, finals, auxes = self._target_forward(output[-1:] + drafted, cache)
            verify_steps += 1
            drafted_total += len(drafted)
            accepted = 0
            bonus: int | None = None
            for index, token in enumerate(drafted):
                if greedy:
                    if int(logits[index].argmax()) != token:
                        break
                else:
                    p = _probs(logits[index], temperature)
                    q_full = torch.zeros_like(p)
                    q_full[self.runner.to_target_ids(torch.arange(draft_probs[index].numel()))] = (
                        draft_probs[index]
                    )
                    ratio = float(p[token] / q_full[token]) if q_full[token] > 0 else 0.0
                    if float(torch.rand((), generator=generator)) >= min(1.0, ratio):
                        residual = torch.clamp(p - q_full, min=0)
                        total = float(residual.sum())
                        residual = residual / total if total > 0 else p
                        bonus = int(torch.multinomial(residual, 1, generator=generator))
                        break
                accepted += 1
                if token == eos:
                    break
            stopped = accepted > 0 and drafted[accepted - 1] == eos
            if bonus is None and not stopped:
                bonus = sample(logits[accepted])
            accepted_total += accepted
            kept = accepted + 1  # output[-1] and the accepted drafts were read by the target
            cache.crop(position + kept)
            final_chunks.append(finals[:kept])
            aux_chunks.append(auxes[:kept])
            new_tokens = drafted[:accepted] + ([bonus] if bonus is not None else [])
            output.extend(new_tokens)
            # Rebuild the draft's positions from the verified target features.
            self.runner.crop(position)
            if output[-1] != eos and len(output) < max_new_tokens:
                tokens = torch.tensor(output[-kept:])
                hidden, draft_logits = self.runner.step(tokens, self.runner.project(auxes[:kept]))
            position += kept
        finish = "stop" if output and output[-1] == eos else "length"
        output = output[:max_new_tokens]
        return Generation(
            prompt_ids=list(prompt_ids),
            output_ids=output,
            finish_reason=finish,
            verify_steps=verify_steps,
            accepted_draft_tokens=accepted_total,
            drafted_tokens=drafted_total,
            final_states=torch.cat(final_chunks)[: len(prompt_ids) + len(output)],
            aux_states=torch.cat(aux_chunks)[: len(prompt_ids) + len(output)],
        )


def acceptance_rate(generation: Generation) -> float:
    return (
        generation.accepted_draft_tokens / generation.drafted_tokens
        if generation.drafted_tokens
        else math.nan
    )

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

__all__ = ["MIN_TEMPERATURE", "DraftRunner", "Generation", "SpeculativeDecoder"]

import dataclasses
import time
from datetime import datetime
from typing import Any

import torch

from tide_lib.lake.schema import CapturedRecord
from tide_lib.serving.k_policy import RoundTimings
from tide_lib.target_model.hidden import HiddenStateCapture


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
    timings: RoundTimings = dataclasses.field(default_factory=lambda: RoundTimings(0, []))

    def _read_tokens(self) -> tuple[list[int], list[int]]:
        """The tokens the target read and their loss mask (1 on output)."""
        length = int(self.final_states.shape[0])
        prompt = len(self.prompt_ids)
        return (self.prompt_ids + self.output_ids)[:length], [0] * prompt + [1] * (length - prompt)

    def captured_record(
        self,
        request_id: str,
        *,
        target_id: str,
        started_at: datetime,
        draft_version: str = "",
        segment: str | None = None,
    ) -> CapturedRecord:
        """This request as the lake stores it (the capture contract of ``lake.schema``)."""
        return CapturedRecord.of_forward(
            request_id,
            started_at,
            self._read_tokens(),
            (self.final_states, self.aux_states),
            target_id=target_id,
            draft_version=draft_version,
            spec_verify_ct=self.verify_steps,
            spec_accept_tokens=self.accepted_draft_tokens,
            completion_tokens=len(self.output_ids),
            segment=segment,
        )

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, bonus included (SGLang's definition)."""
        if not self.verify_steps:
            return 0.0
        return (self.accepted_draft_tokens + self.verify_steps) / self.verify_steps


class DraftRunner:
    """Incremental inference of SpecForge's ``LlamaForCausalLMEagle3`` with a KV cache.

    Written for a chain draft's few rows per step, where per-call overhead is most of
    the cost: the KV cache is one buffer grown by doubling (a step writes its rows, a
    crop moves the length back; no copy of the whole cache per step), grouped-query
    heads are read in place by the attention (no repeated copy), a single query attends
    to every position without a mask, and only the last position's logits are computed,
    the only ones a chain draft reads.
    """

    _MIN_CAPACITY = 64

    def __init__(self, draft: Any) -> None:
        self.draft = draft.eval()
        layer = draft.midlayer
        self.attn = layer.self_attn
        self._keys: torch.Tensor | None = None  # [1, kv_heads, capacity, head_dim]
        self._values: torch.Tensor | None = None
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def crop(self, length: int) -> None:
        self._length = min(self._length, length)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        projected: torch.Tensor = self.draft.project_hidden_states(aux)
        return projected

    def _append(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's keys/values [1, kv_heads, q, dim] after the kept positions;
        returns the whole cache so far."""
        start, end = self._length, self._length + int(keys.shape[2])
        old_keys, old_values = self._keys, self._values
        fits = (
            old_keys is not None
            and int(old_keys.shape[2]) >= end
            and (old_keys.dtype, old_keys.device) == (keys.dtype, keys.device)
        )
        if not fits:  # grown (or moved with the draft) past what the buffer holds
            shape = (1, keys.shape[1], max(self._MIN_CAPACITY, 2 * end), keys.shape[3])
            self._keys, self._values = keys.new_empty(shape), values.new_empty(shape)
            if old_keys is not None and old_values is not None and start:
                self._keys[:, :, :start] = old_keys[:, :, :start]
                self._values[:, :, :start] = old_values[:, :, :start]
        assert self._keys is not None and self._values is not None
        self._keys[:, :, start:end] = keys
        self._values[:, :, start:end] = values
        self._length = end
        return self._keys[:, :, :end], self._values[:, :, :end]

    @torch.no_grad()
    def step(
        self, token_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append positions for ``token_ids`` [q] with input states ``hidden`` [q, H].

        Returns the layer outputs [q, H] (the next step's input state) and the draft
        logits [draft_vocab] of the token after the last position.
        """
        from specforge.modeling.draft.llama3_eagle import rotate_half  # noqa: PLC0415

        layer, attn = self.draft.midlayer, self.attn
        start, count = self._length, int(token_ids.shape[0])
        embeds = self.draft.embed_input_ids(token_ids[None]).to(hidden.dtype)
        residual = hidden[None]
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(residual)), dim=-1)
        heads, kv_heads, dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        q = attn.q_proj(x).view(1, count, heads, dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, count, kv_heads, dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, count, kv_heads, dim).transpose(1, 2)
        cos, sin = attn.rotary_emb(q, seq_len=start + count)  # positions 0.. of the cache
        cos = cos.reshape(-1, dim)[start : start + count]
        sin = sin.reshape(-1, dim)[start : start + count]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys, values = self._append(k, v)
        # row i sees the cache and the step's rows up to i; a single row sees everything
        mask = (
            None
            if count == 1
            else torch.ones(count, start + count, dtype=torch.bool, device=q.device).tril(start)
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=kv_heads != heads
        )
        out = attn.o_proj(out.transpose(1, 2).reshape(1, count, heads * dim))
        hidden_out = residual + out
        hidden_out = hidden_out + layer.mlp(layer.post_attention_layernorm(hidden_out))
        logits = self.draft.compute_logits(hidden_out[0, -1])
        return hidden_out[0], logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        mapped: torch.Tensor = draft_ids + self.draft.d2t[draft_ids]
        return mapped


def _plain_head(target: Any) -> torch.nn.Linear | None:
    """The target's LM head when logits are nothing but ``head(final states)``; None for
    heads that scale or cap them (the full forward then computes the logits)."""
    head = target.get_output_embeddings()
    config = target.config
    plain = (
        getattr(config, "final_logit_softcapping", None) is None
        and getattr(config, "logit_scale", None) is None
        and getattr(config, "logits_scaling", 1) == 1  # Granite divides by it
    )
    return head if plain and type(head) is torch.nn.Linear else None


def _head_logits(head: torch.nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """``head(states)`` for a verify's few rows [q, H], computed as ``(W @ states^T)^T``.

    CPU BLAS picks a slow kernel for a wide head times a few rows: on the demo target's
    8192 x 256 head, 4 rows (a k=3 verify) took 2.4 ms through ``F.linear`` against
    0.5-1.1 ms transposed (1-2 threads), the largest single cost of a verify round.
    """
    logits = (head.weight @ states.to(head.weight.dtype).T).T
    return logits if head.bias is None else logits + head.bias


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
        self.device = next(target.parameters()).device
        self._head = _plain_head(target)
        # With a plain head the logits come from the captured final states: the decoder alone.
        self._forward_model = target if self._head is None else target.get_decoder()
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
            out = self._forward_model(
                input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True
            )
        final, aux = self.capture.take()
        logits = out.logits[0] if self._head is None else _head_logits(self._head, final[0])
        return logits, out.past_key_values, final[0], aux[0]

    def _timed_forward(
        self, ids: list[int], cache: Any, timings: RoundTimings
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        started = _clock(self.device)
        result = self._target_forward(ids, cache)
        timings.target_forwards.append((len(ids), _clock(self.device) - started))
        return result

    def _timed_draft(
        self, tokens: torch.Tensor, hidden: torch.Tensor, timings: RoundTimings
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.runner is not None
        started = _clock(self.device)
        result = self.runner.step(tokens, hidden)
        timings.draft_seconds += _clock(self.device) - started
        timings.draft_forwards += 1
        return result

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
        num_steps: int | None = None,
        probe_rounds: int | None = None,
    ) -> Generation:
        """Generate with ``num_steps`` draft tokens per verify (default: the decoder's k).

        ``num_steps=0``, ``speculative=False`` or no draft: plain decoding, no draft step.
        The result's ``timings`` hold the wall cost of every draft and target forward
        after the prefill, and each verify round's (drafted, accepted).
        ``probe_rounds``: speculate that many verify rounds, then decode the rest plainly;
        ``timings`` then hold the speculative rounds alone, marked ``probe``.
        """
        k = self.num_steps if num_steps is None else num_steps
        if k < 0:
            raise ValueError(f"num_steps must be at least 0, got {k}")
        use_draft = speculative and self.runner is not None and k > 0
        run = _Run(
            self,
            prompt_ids,
            max_new_tokens,
            temperature=temperature,
            generator=generator,
            ignore_eos=ignore_eos,
        )
        run.timings.k = k if use_draft else 0
        if use_draft:
            run.speculate(k, probe_rounds if probe_rounds and probe_rounds > 0 else None)
        else:
            run.plain(run.timings)
        return run.result()


class _Run:
    """One request's decoding state: the output so far, the caches and what was measured."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float,
        generator: torch.Generator | None,
        ignore_eos: bool,
    ) -> None:
        self.decoder = decoder
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.greedy = temperature < MIN_TEMPERATURE
        self.generator = generator
        self.eos = None if ignore_eos else decoder.eos_token_id
        self.timings = RoundTimings(0, [])
        logits, self.cache, finals, self.auxes = decoder._target_forward(prompt_ids, None)
        self.final_chunks, self.aux_chunks = [finals], [self.auxes]
        self.output = [self.sample(logits[-1])]
        self.position = len(prompt_ids)  # position of output[-1], not yet read by the target
        self.verify_steps = self.accepted_total = self.drafted_total = 0

    def sample(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(logits.argmax())
        probs = _probs(logits, self.temperature)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def running(self) -> bool:
        return len(self.output) < self.max_new_tokens and self.output[-1] != self.eos

    def plain(self, timings: RoundTimings) -> None:
        """Decode plainly to the end, measured into ``timings``."""
        started, before = _clock(self.decoder.device), len(self.output)
        while self.running():
            logits, self.cache, finals, auxes = self.decoder._timed_forward(
                self.output[-1:], self.cache, timings
            )
            self.final_chunks.append(finals)
            self.aux_chunks.append(auxes)
            self.output.append(self.sample(logits[-1]))
            self.position += 1
        timings.decode_seconds = _clock(self.decoder.device) - started
        timings.emitted = len(self.output) - before

    def speculate(self, k: int, probe_rounds: int | None = None) -> None:
        """Speculate to the end, or for ``probe_rounds`` verify rounds and then decode the
        rest plainly, outside the measured timings (a probe measures acceptance and
        costs, at the price of a few rounds instead of a whole request)."""
        decoder, runner = self.decoder, self.decoder.runner
        assert runner is not None
        runner.reset()
        prefill, before = _clock(decoder.device), len(self.output)
        tokens = torch.tensor(self.prompt_ids[1:] + self.output[-1:])
        hidden, draft_logits = runner.step(tokens, runner.project(self.auxes))  # draft prefill
        started = _clock(decoder.device)
        self.timings.draft_prefill_seconds = started - prefill

        def speculating() -> bool:
            return self.running() and (probe_rounds is None or self.verify_steps < probe_rounds)

        while speculating():
            budget = min(k, self.max_new_tokens - len(self.output))
            drafted, draft_probs = self._draft(hidden[-1:], draft_logits, budget)
            logits, self.cache, finals, auxes = decoder._timed_forward(
                self.output[-1:] + drafted, self.cache, self.timings
            )
            accepted, bonus, stopped = self._verify(logits, drafted, draft_probs)
            self.verify_steps += 1
            self.drafted_total += len(drafted)
            self.accepted_total += accepted
            self.timings.rounds.append((accepted if stopped else len(drafted), accepted))
            kept = accepted + 1  # output[-1] and the accepted drafts were read by the target
            self.cache.crop(self.position + kept)
            self.final_chunks.append(finals[:kept])
            self.aux_chunks.append(auxes[:kept])
            self.output.extend(drafted[:accepted] + ([bonus] if bonus is not None else []))
            # Rebuild the draft's positions from the verified target features.
            runner.crop(self.position)
            if speculating():
                tokens = torch.tensor(self.output[-kept:])
                hidden, draft_logits = decoder._timed_draft(
                    tokens, runner.project(auxes[:kept]), self.timings
                )
            self.position += kept
        self.timings.decode_seconds = _clock(decoder.device) - started
        self.timings.emitted = len(self.output) - before
        if self.running():  # a probe's rest, unmeasured: the request's k did not serve it
            self.timings.probe = True
            self.plain(RoundTimings(0, []))

    def _draft(
        self, last_hidden: torch.Tensor, last_logits: torch.Tensor, budget: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Chain-draft ``budget`` tokens (target ids) and, when sampling, their draft probs;
        fewer when the draft proposes the end of the output (the verify reads no further)."""
        runner = self.decoder.runner
        assert runner is not None
        drafted: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for step in range(budget):
            if self.greedy:
                draft_id = int(last_logits.argmax())
            else:
                probs = _probs(last_logits, self.temperature)
                draft_id = int(torch.multinomial(probs, 1, generator=self.generator))
                draft_probs.append(probs)
            token = int(runner.to_target_ids(torch.tensor(draft_id)))
            drafted.append(token)
            if token == self.eos:  # what follows an end would never be emitted
                break
            if step + 1 < budget:
                last_hidden, last_logits = self.decoder._timed_draft(
                    torch.tensor([token]), last_hidden, self.timings
                )
        return drafted, draft_probs

    def _verify(
        self, logits: torch.Tensor, drafted: list[int], draft_probs: list[torch.Tensor]
    ) -> tuple[int, int | None, bool]:
        """(accepted drafts, bonus token or None, stopped at an accepted EOS)."""
        runner = self.decoder.runner
        assert runner is not None
        accepted = 0
        bonus: int | None = None
        for index, token in enumerate(drafted):
            if self.greedy:
                if int(logits[index].argmax()) != token:
                    break
            else:
                p = _probs(logits[index], self.temperature)
                q_full = torch.zeros_like(p)
                q_full[runner.to_target_ids(torch.arange(draft_probs[index].numel()))] = (
                    draft_probs[index]
                )
                ratio = float(p[token] / q_full[token]) if q_full[token] > 0 else 0.0
                if float(torch.rand((), generator=self.generator)) >= min(1.0, ratio):
                    residual = torch.clamp(p - q_full, min=0)
                    total = float(residual.sum())
                    residual = residual / total if total > 0 else p
                    bonus = int(torch.multinomial(residual, 1, generator=self.generator))
                    break
            accepted += 1
            if token == self.eos:
                break
        stopped = accepted > 0 and drafted[accepted - 1] == self.eos
        if bonus is None and not stopped:
            bonus = self.sample(logits[accepted])
        return accepted, bonus, stopped

    def result(self) -> Generation:
        output = self.output
        finish = "stop" if output and output[-1] == self.eos else "length"
        output = output[: self.max_new_tokens]
        length = len(self.prompt_ids) + len(output)
        return Generation(
            prompt_ids=self.prompt_ids,
            output_ids=output,
            finish_reason=finish,
            verify_steps=self.verify_steps,
            accepted_draft_tokens=self.accepted_total,
            drafted_tokens=self.drafted_total,
            final_states=torch.cat(self.final_chunks)[:length],
            aux_states=torch.cat(self.aux_chunks)[:length],
            timings=self.timings,
        )


def _clock(device: torch.device) -> float:
    """Wall time, after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

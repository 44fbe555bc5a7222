"""Offline acceptance length: replay chain drafting against captured target states.

For greedy traffic the captured tokens after the prompt *are* the target's greedy
continuation, and the captured aux states are the features serving gave the
draft. Re-running the draft's chain on them, with the engine's own
:class:`~tide_lib.serving.speculative.DraftRunner` and the engine's rules (k
tokens per round, the accepted prefix plus one bonus token, the last round
capped by the output length), gives the acceptance length live serving would
have measured, without any target forward pass. The one token the target
emitted but never read (the last) is recovered from the last final state
through the target's ``lm_head``.

Acceptance length is pooled as SGLang pools it: tokens emitted by verify steps
(bonus included) over verify steps, summed over all requests of a segment.

Samples are lake records (:class:`~tide_lib.lake.schema.CapturedRecord`) or
training files in SpecForge's offline layout (:func:`replay_sample`): the trainer
scores its held-out split with the same replay while it trains.
"""

from __future__ import annotations

__all__ = [
    "AcceptanceCount",
    "ReplaySample",
    "acceptance_ceiling",
    "acceptance_counts",
    "content_digest",
    "content_fraction",
    "digest_fraction",
    "drop_margin",
    "fall_below",
    "length_margin",
    "no_room_to_gain",
    "offline_acceptance",
    "paired_drop",
    "replay_request",
    "replay_sample",
    "significant_drop",
]

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tide_lib.evaluation.gate import t95
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.serving.speculative import DraftRunner
from tide_lib.training.draft import TargetHead


class ReplaySample(Protocol):
    """What a replay reads of a captured request (a lake record has these and more)."""

    @property
    def input_ids(self) -> torch.Tensor: ...  # [T]
    @property
    def loss_mask(self) -> torch.Tensor: ...  # [T], 1 on output tokens
    @property
    def hidden_states(self) -> torch.Tensor: ...  # [T, H]
    @property
    def aux_hidden_states(self) -> torch.Tensor: ...  # [T, 3H]


@dataclasses.dataclass(frozen=True)
class _OfflineSample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: torch.Tensor


def content_digest(input_ids: torch.Tensor) -> bytes:
    """A request's identity by its tokens: duplicates (the same prompt answered the same
    way) share it, so they fall on the same side of every held-out split and count
    once in a held-out figure (two copies of one request are not two pieces of evidence)."""
    return hashlib.sha256(input_ids.reshape(-1).to(torch.int64).numpy().tobytes()).digest()


def content_fraction(input_ids: torch.Tensor, salt: bytes = b"") -> float:
    """Where a request falls in [0, 1) for a held-out split (see :func:`content_digest`).

    Splits made one after the other (the cycle's, then the trainer's validation split
    of what the cycle kept) need different ``salt``: the same hash would put every
    survivor of the first split above the second's threshold.
    """
    return digest_fraction(content_digest(input_ids), salt)


def digest_fraction(digest: bytes, salt: bytes = b"") -> float:
    """:func:`content_fraction` of a request whose :func:`content_digest` is at hand (a
    loop that needs both hashes the tokens once)."""
    if salt:
        digest = hashlib.sha256(salt + digest).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def replay_sample(raw: Mapping[str, Any]) -> ReplaySample:
    """A training file's dict (SpecForge's offline layout) as a replayable sample."""
    return _OfflineSample(
        input_ids=raw["input_ids"].reshape(-1),
        loss_mask=raw["loss_mask"].reshape(-1),
        hidden_states=raw["hidden_state"].reshape(-1, raw["hidden_state"].shape[-1]),
        aux_hidden_states=raw["aux_hidden_state"].reshape(-1, raw["aux_hidden_state"].shape[-1]),
    )


def significant_drop(
    before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]], tolerance: float
) -> float | None:
    """The drop from ``before`` to ``after`` if it exceeds ``tolerance`` beyond its margin
    of error (:func:`drop_margin`), else None."""
    drop, margin = drop_margin(before, after)
    return drop if drop - margin > tolerance else None


def drop_margin(
    before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]]
) -> tuple[float, float]:
    """``(drop, one-sided 95% margin of error)``: the paired standard error times
    Student's t for the number of requests (two requests: 6.3 errors; thirty: 1.7)."""
    drop, error = paired_drop(before, after)
    return drop, (t95(len(before) - 1) * error if error else 0.0)


def length_margin(per_request: Sequence[tuple[int, int]]) -> float:
    """One-sided 95% margin of error of one pooled acceptance length (``(emitted,
    verify)`` per request): the delta-method standard error of a ratio of sums times
    Student's t. What a figure measured on a sample of requests can be trusted to: the
    margin of its fall below 0 (:func:`fall_below`)."""
    return fall_below([(0.0, per_request)])[1]


def fall_below(
    requests: Sequence[tuple[float, Sequence[tuple[int, int]]]],
) -> tuple[float, float]:
    """``(fall, one-sided 95% margin of error)`` of requests' pooled acceptance length
    below what each was held to: ``requests`` pairs a reference (its segment's) with the
    ``(emitted, verify)`` of the requests held to it. The fall is the verify-weighted
    reference less the pooled figure, as SGLang pools (a request weighs by its verify
    steps); its error is the delta method's on the per-request residuals, so requests of
    different segments add evidence without their segments' spread counting as noise.
    With fewer than two requests there is no margin: it is infinite."""
    rows = [(reference, e, v) for reference, pairs in requests for e, v in pairs]
    verify = sum(v for _, _, v in rows)
    if not verify:
        return 0.0, math.inf
    fall = sum(reference * v - e for reference, e, v in rows) / verify
    if len(rows) < 2:
        return fall, math.inf
    residuals = [(reference * v - e - fall * v) / verify for reference, e, v in rows]
    return fall, t95(len(rows) - 1) * _delta_error(residuals)


def _delta_error(residuals: Sequence[float]) -> float:
    """Standard error of a ratio of sums from its linearised per-request residuals
    (the delta method, with the small-sample correction n / (n - 1))."""
    return math.sqrt(len(residuals) / (len(residuals) - 1) * sum(r * r for r in residuals))


def paired_drop(
    before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]]
) -> tuple[float, float]:
    """``(drop, standard error)`` of the pooled acceptance length from ``before`` to
    ``after``, two drafts replayed on the same requests (``(emitted, verify)`` each).

    The error is the paired delta-method estimate for a ratio of sums: requests
    differ far more than drafts do, so pairing them removes most of the noise. With
    fewer than two requests there is no estimate: the error is infinite.
    """
    if len(before) != len(after):
        raise ValueError(f"paired figures need the same requests ({len(before)} vs {len(after)})")
    emitted_0, verify_0 = sum(e for e, _ in before), sum(v for _, v in before)
    emitted_1, verify_1 = sum(e for e, _ in after), sum(v for _, v in after)
    if not verify_0 or not verify_1:
        return 0.0, math.inf
    length_0, length_1 = emitted_0 / verify_0, emitted_1 / verify_1
    if len(before) < 2:
        return length_0 - length_1, math.inf
    residuals = [
        (e0 - length_0 * v0) / verify_0 - (e1 - length_1 * v1) / verify_1
        for (e0, v0), (e1, v1) in zip(before, after, strict=True)
    ]
    return length_0 - length_1, _delta_error(residuals)


def _output_length(sample: ReplaySample) -> int:
    """Output tokens a replay verifies: the masked ones and the one the last state
    predicts; 0 for a record without output (nothing to verify)."""
    mask = sample.loss_mask.tolist()
    return int(sample.input_ids.numel()) + 1 - mask.index(1) if 1 in mask else 0


def _perfect_replay(
    output_length: int, num_steps: int, *, every_position: bool = False
) -> tuple[int, int]:
    """``(emitted, verify steps)`` of a draft that is never wrong, counted as
    :func:`replay_request` counts: the first output token comes from the prefill."""
    produced, emitted, verify_steps = 1, 0, 0
    while produced < output_length:
        accepted = min(num_steps, output_length - produced)  # every draft token right
        emitted += accepted + 1  # and the verify's own token
        verify_steps += 1
        produced += 1 if every_position else accepted + 1
    return emitted, verify_steps


def acceptance_ceiling(
    samples: Iterable[ReplaySample], num_steps: int, *, every_position: bool = False
) -> float:
    """The highest pooled acceptance length any draft can reach on ``samples`` at
    ``num_steps``: what their output lengths allow (a request answered in two tokens
    is verified once, however good the draft). 0.0 when none has a token to verify.
    ``every_position``: counted as :func:`replay_request` counts rounds from every
    output position."""
    count = AcceptanceCount(keep_requests=False)
    for sample in samples:
        count.add(
            *_perfect_replay(_output_length(sample), num_steps, every_position=every_position)
        )
    return count.accept_length


def no_room_to_gain(pairs: Iterable[tuple[int, int]], num_steps: int, gain: float) -> bool:
    """Can no draft beat by ``gain`` the pooled acceptance length of requests replayed
    from every output position (a draft's ``(emitted, verify steps)`` at ``num_steps``)?
    True where it is less than ``gain`` below their ceiling (:func:`acceptance_ceiling`),
    or at it: short answers served perfectly, or nothing to verify. A round starts at
    each output position but the first, so a request's verify steps tell its output
    length."""
    emitted = verify_steps = perfect = 0
    for request_emitted, request_steps in pairs:
        emitted, verify_steps = emitted + request_emitted, verify_steps + request_steps
        perfect += _perfect_replay(request_steps + 1, num_steps, every_position=True)[0]
    if not verify_steps:
        return True
    room = (perfect - emitted) / verify_steps
    return room <= 1e-9 or room < gain - 1e-9


@torch.no_grad()
def replay_request(
    runner: DraftRunner,
    lm_head: torch.nn.Module,
    sample: ReplaySample,
    num_steps: int,
    *,
    every_position: bool = False,
) -> tuple[int, int]:
    """``(tokens emitted by verify steps, verify steps)`` of one greedy request.

    ``every_position``: a round starts at every output position, not only where the
    last round ended (see :func:`acceptance_counts`).
    """
    output_len = _output_length(sample)
    if not output_len:
        return 0, 0
    aux = sample.aux_hidden_states.float()
    last_token = int(lm_head(sample.hidden_states[-1].float()).argmax())
    tokens = [*sample.input_ids.tolist(), last_token]  # prompt + every output token
    prompt_len = len(tokens) - output_len
    runner.reset()
    hidden, logits = runner.step(
        torch.tensor(tokens[1 : prompt_len + 1]), runner.project(aux[:prompt_len])
    )
    position, produced = prompt_len, 1  # output[0] came from the prefill
    emitted = verify_steps = 0
    while produced < output_len:
        budget = min(num_steps, output_len - produced)
        drafted: list[int] = []
        last_hidden, last_logits = hidden[-1:], logits
        for step in range(budget):
            token = int(runner.to_target_ids(last_logits.argmax()))
            drafted.append(token)
            if step + 1 < budget:
                last_hidden, last_logits = runner.step(torch.tensor([token]), last_hidden)
        truth = tokens[position + 1 : position + 1 + budget]
        accepted = 0
        while accepted < min(len(drafted), len(truth)) and drafted[accepted] == truth[accepted]:
            accepted += 1
        # Counted as the engine counts: accepted drafts plus one target token per verify.
        emitted += accepted + 1
        verify_steps += 1
        produced += accepted + 1
        runner.crop(position)
        if every_position:  # the next round starts one token on, whatever was accepted
            produced -= accepted
        if produced < output_len:
            kept = 1 if every_position else accepted + 1
            hidden, logits = runner.step(
                torch.tensor(tokens[position + 1 : position + 1 + kept]),
                runner.project(aux[position : position + kept]),
            )
            position += kept
    return emitted, verify_steps


def offline_acceptance(
    draft: Any,
    target_dir: Path,
    segments: Mapping[str, Iterable[ReplaySample]],
    ks: Sequence[int],
    *,
    every_position: bool = False,
) -> dict[str, dict[int, AcceptanceCount]]:
    """Acceptance length of ``draft`` per segment and per k, from captured states only."""
    return acceptance_counts(
        draft, TargetHead(target_dir), segments, ks, every_position=every_position
    )


def acceptance_counts(
    draft: Any,
    lm_head: torch.nn.Module,
    segments: Mapping[str, Iterable[ReplaySample]],
    ks: Sequence[int],
    *,
    every_position: bool = False,
) -> dict[str, dict[int, AcceptanceCount]]:
    """:func:`offline_acceptance` with the target's output layer already at hand.

    ``every_position``: the evidence for comparing two drafts. The engine's rounds
    start where the last one ended, so where they fall depends on the draft itself:
    two drafts that differ by one token are measured on different positions, and a
    request's figure jumps. A round started at every output position measures each
    draft on all positions alike, paired position by position across drafts (about
    the acceptance length times the replay's cost). The figure is in the same units,
    tokens per verify step, but not the engine's: it weighs every position alike where
    the engine's weighs those its rounds happen to start at. On the demo workload its
    paired margins of error were 0.78 of the engine rounds' (39 trainer evaluations)
    and its trend through training far steadier.
    """
    runner = DraftRunner(draft)
    results: dict[str, dict[int, AcceptanceCount]] = {}
    for name, samples in segments.items():
        counts = {k: AcceptanceCount() for k in ks}
        for sample in samples:
            for k in ks:
                counts[k].add(
                    *replay_request(runner, lm_head, sample, k, every_position=every_position)
                )
        results[name] = counts
    return results

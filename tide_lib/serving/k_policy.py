"""How many draft tokens to speculate: the k that pays, measured while serving.

Speculative decoding is slower than plain decoding when the draft misses often or
a draft step costs too much next to a target step (measured 0.87x-0.96x on CPU
with a fitted draft). The engine therefore measures, with probe generations at
every k before it serves (:meth:`KController.calibrate`) and then as it serves, the
wall cost of a draft forward, of a target forward as a function of how many tokens it
reads (a verify at k reads k + 1; plain decoding reads 1), of the draft's pass over a
speculative request's prompt (spread over the tokens a request emits), and the draft's
per-position conditional acceptance, and serves each request at the k in
``0..max_k`` with the most expected tokens per second; k = 0 is plain decoding.

:func:`choose_k` is the decision, a pure function of costs and acceptance, so
tests and the fleet's recommendation for SGLang servers (fixed k) use it as is.
:class:`KController` keeps the estimates: costs are shared by all requests;
acceptance is kept overall and per client segment label, a segment's estimate
shrunk towards the overall one until it has rounds of its own. Positions never
measured borrow the previous position's rate and position 0 starts at 1.0
(optimism: an untried k gets tried), a request now and then runs at another k so
estimates stay current: the model's k every other time where the realized rates
overrule it, else in turn plain decoding while speculating and the neighbours of the
choice, turns kept per segment (every ``explore_every`` requests at first, half as
often after each exploration that left the choice as it was, down to one in
``8 * explore_every``; a new choice or a draft swap starts over), and a draft swap
forgets acceptance.

The cost model is a model: on CPU it misjudged speculation by several per cent
(k=4 expected 5% above plain decoding, served 8% below it). So the throughput each
k really delivered (output tokens per second of decoding and the draft's prefill) has the
last word: a k that did not beat plain decoding is not served; the best realized k that
did is, else plain. A k with no figure of its own yet is judged by the model corrected by
its error on the k's that have one (a cost it does not see weighs on every k). "Beat" is
read both from running rates and pair by pair against plain decoding measured beside it
(:class:`RealizedRates`), since the machine's load moves only the served k's figures;
nothing speculates before a plain request has measured the rate to beat as it is now (a
calibration probe's may be stale); and a choice that moved serves the old choice again
soon, under the same load.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MIN_GAIN",
    "MAX_SEGMENTS",
    "MIN_MEASURED_FORWARDS",
    "RECHECK_AFTER",
    "AcceptanceEstimate",
    "CostModel",
    "KChoice",
    "KController",
    "KPlan",
    "RealizedRates",
    "RoundTimings",
    "choose_k",
    "expected_tokens_per_round",
    "geometric_acceptance",
    "recommend_k",
]

import dataclasses
import logging
import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Labels come from clients: at most this many segments are tracked (least recent dropped).
MAX_SEGMENTS = 64
# What a speculating k must beat plain decoding by to be chosen (a share: 2 %).
DEFAULT_MIN_GAIN = 0.02
_COST_EMA = 0.2  # weight of a request (a mean-sized one in realized rates) in running averages
# Weight of one target forward in its token count's running cost: a request's short last
# verify is one noisy forward and moves the figure by 5 %, a request of 14 rounds by half.
_FORWARD_EMA = 0.05
_PRIOR_ROUNDS = 2.0  # pseudo-rounds of the prior behind each position's acceptance
_SEGMENT_PRIOR_ROUNDS = 8.0  # pseudo-rounds of the overall estimate behind a segment's
_EXPLORE_BACKOFF_LIMIT = 8  # exploration slows to one in explore_every x this requests
_VETOED_BACKOFF_LIMIT = 2  # ... or this, while the realized rates overrule the model
MIN_MEASURED_FORWARDS = 8  # forwards at a token count before its figure is used as is
_FIT_WEIGHT_CAP = 64  # forwards behind a token count's weight in the verify-cost line
MIN_REALIZED = 3  # requests at a k before what it delivered can veto the model's choice
RECHECK_AFTER = 2  # requests after the choice moved before the old choice is served again
_PAIR_WITHIN = 3  # requests apart that a request at k and one at plain decoding still pair
_DRIFT = 0.1  # log-fall of a served k's rate since its last pair that pairs it again
_CONFIRMED_FALL = 0.3  # log-ratio below k's average that confirms the fall (about 1.4 noise)


@dataclasses.dataclass(frozen=True)
class KChoice:
    """The chosen k and the expected output tokens/s at every k (index = k)."""

    k: int
    tokens_per_s: tuple[float, ...]


def expected_tokens_per_round(acceptance: Sequence[float], k: int) -> float:
    """Tokens a chain verify at k emits on average: the accepted drafts plus the bonus.

    ``acceptance[i]`` is the chance that draft position i is accepted given that
    positions before it were.
    """
    expected, reach = 1.0, 1.0
    for position in range(k):
        reach *= acceptance[position]
        expected += reach
    return expected


def choose_k(
    acceptance: Sequence[float],
    draft_step_s: float,
    verify_s: Sequence[float],
    *,
    max_k: int,
    min_gain: float = 0.0,
    draft_prefill_s_per_token: float = 0.0,
) -> KChoice:
    """The k in ``0..max_k`` with the most expected tokens/s.

    ``verify_s[k]``: seconds of a step at k besides its draft forwards, i.e. a target forward
    reading k + 1 tokens and its bookkeeping (``verify_s[0]`` is a plain decode step);
    ``draft_step_s``: seconds of a draft forward; a round at k runs k
    of them (k - 1 chained steps and the pass over the verified tokens);
    ``draft_prefill_s_per_token``: the draft's pass over a speculative request's prompt,
    spread over the tokens a request emits. A k > 0 is chosen
    only when it beats plain decoding by more than ``min_gain`` (a share, 0.02 = 2 %); ties
    go to the smaller k.
    """
    if len(acceptance) < max_k or len(verify_s) <= max_k:
        raise ValueError(f"need {max_k} acceptance rates and {max_k + 1} verify costs")
    rates = [1.0 / verify_s[0]]
    for k in range(1, max_k + 1):
        seconds = k * draft_step_s + verify_s[k]
        per_token = seconds / expected_tokens_per_round(acceptance, k)
        rates.append(1.0 / (per_token + draft_prefill_s_per_token))
    best = 0
    for k in range(1, max_k + 1):
        if rates[k] > rates[best] and rates[k] > rates[0] * (1.0 + min_gain):
            best = k
    return KChoice(k=best, tokens_per_s=tuple(rates))


def geometric_acceptance(accept_length: float, k: int) -> float:
    """The constant per-position acceptance that gives ``accept_length`` at k (bisection).

    What a server reports is one figure (SGLang's ``avg_spec_accept_length``, bonus
    included); assuming every position accepts at the same rate spreads it over positions.
    """
    if k < 1:
        raise ValueError("an acceptance length needs k >= 1")
    target = min(max(accept_length, 1.0), k + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if expected_tokens_per_round([middle] * k, k) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def recommend_k(
    accept_length: float,
    launch_k: int,
    *,
    draft_cost_ratio: float,
    verify_token_cost_ratio: float = 0.0,
    max_k: int | None = None,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> KChoice:
    """The k to relaunch a fixed-k server with, from its acceptance length at ``launch_k``.

    Costs are relative to a plain decode step: a draft forward costs ``draft_cost_ratio``,
    a verify at k costs ``1 + k * verify_token_cost_ratio`` (about 0 on a GPU at small
    batch). ``tokens_per_s`` is then tokens per plain-step time.
    """
    limit = launch_k if max_k is None else max_k
    rate = geometric_acceptance(accept_length, launch_k)
    verify = [1.0 + k * verify_token_cost_ratio for k in range(limit + 1)]
    return choose_k([rate] * limit, draft_cost_ratio, verify, max_k=limit, min_gain=min_gain)


@dataclasses.dataclass(frozen=True)
class KPlan:
    """How to serve one request: at ``k``; a probe (``probe_rounds`` set) speculates that
    many verify rounds and decodes the rest plainly."""

    k: int
    probe_rounds: int | None = None


@dataclasses.dataclass
class RoundTimings:
    """What one generation measured, for the controller (prefill excluded)."""

    k: int
    rounds: list[tuple[int, int]]  # (drafted, accepted) per verify round
    draft_seconds: float = 0.0
    draft_forwards: int = 0
    target_forwards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    decode_seconds: float = 0.0  # all of decoding after the prefill, bookkeeping included
    emitted: int = 0  # output tokens decoding delivered (after the prefill's first)
    draft_prefill_seconds: float = 0.0  # the draft's pass over the prompt (speculation only)
    # A probe speculated its first rounds only and decoded the rest plainly, unmeasured:
    # what it measured is acceptance and costs, not what its k delivers.
    probe: bool = False


class CostModel:
    """Running wall costs: a draft forward, a target forward by tokens read, bookkeeping,
    and the draft's prefill per emitted token.

    Bookkeeping is what a step costs besides its forwards (sampling, acceptance checks,
    cache crops): on a small model it is a real share, and larger per speculative round
    than per plain step, so each is measured from the request's wall time and added to
    the verify cost of its kind.
    """

    def __init__(self) -> None:
        self.draft_step_s: float | None = None
        self.target_s: dict[int, float] = {}  # tokens read -> seconds
        self.target_forwards: dict[int, int] = {}  # tokens read -> forwards measured
        self.round_overhead_s = 0.0  # per speculative round
        self.plain_overhead_s = 0.0  # per plain decode step
        # a speculative request's draft prefill, and the tokens a request emits (running)
        self.draft_prefill_s: float | None = None
        self.emitted_per_request: float | None = None

    @staticmethod
    def blend(old: float | None, new: float) -> float:
        return new if old is None else (1.0 - _COST_EMA) * old + _COST_EMA * new

    def observe(self, timings: RoundTimings) -> None:
        if timings.draft_forwards:
            per_forward = timings.draft_seconds / timings.draft_forwards
            self.draft_step_s = self.blend(self.draft_step_s, per_forward)
        if timings.k and timings.draft_prefill_seconds > 0:
            self.draft_prefill_s = self.blend(self.draft_prefill_s, timings.draft_prefill_seconds)
        if timings.emitted and not timings.probe:  # a probe measured part of its request
            self.emitted_per_request = self.blend(self.emitted_per_request, timings.emitted)
        by_tokens: dict[int, list[float]] = {}
        for tokens, seconds in timings.target_forwards:
            by_tokens.setdefault(tokens, []).append(seconds)
        for tokens, seconds_list in by_tokens.items():
            typical = statistics.median(seconds_list)  # one stalled forward is no cost
            if typical <= 0:
                continue  # a coarse clock's 0 s is no cost either
            added = len(seconds_list)
            count = self.target_forwards.get(tokens, 0) + added
            old = self.target_s.get(tokens)
            self.target_s[tokens] = _running_average(old, typical, count, added, _FORWARD_EMA)
            self.target_forwards[tokens] = count
        steps = len(timings.target_forwards)
        if not steps or timings.decode_seconds <= 0:
            return
        forwards = timings.draft_seconds + sum(s for _, s in timings.target_forwards)
        overhead = max(0.0, timings.decode_seconds - forwards) / steps
        if timings.k:
            self.round_overhead_s = self.blend(self.round_overhead_s or None, overhead)
        else:
            self.plain_overhead_s = self.blend(self.plain_overhead_s or None, overhead)

    def verify_costs(self, max_k: int) -> list[float] | None:
        """Seconds of a step at k besides its draft forwards, k = 0..max_k; None before any.

        A target forward reading k + 1 tokens plus the step's bookkeeping. A token count
        read by :data:`MIN_MEASURED_FORWARDS` forwards or more costs what it measured
        (one plain request measures plain decoding); the others come from a line through
        those counts (through every count measured while fewer than two are), each
        weighted by its forwards (at most :data:`_FIT_WEIGHT_CAP`), slope at least 0. A
        count read by a few forwards, such as requests' short last verifies, is a few
        noisy figures: read as is, 28 ms at 3 tokens against 17 ms at 5 made k=1 and k=2
        look slower than plain decoding in the serve bench, and they were never tried.
        """
        if not self.target_s:
            return None
        points = [
            (n, s, min(self.target_forwards.get(n, 1), _FIT_WEIGHT_CAP))
            for n, s in self.target_s.items()
        ]
        measured = [point for point in points if point[2] >= MIN_MEASURED_FORWARDS]
        line = _weighted_line(measured if len(measured) > 1 else points)
        floor = min(self.target_s.values()) * 0.5

        def forward(tokens: int) -> float:
            if self.target_forwards.get(tokens, 0) >= MIN_MEASURED_FORWARDS:
                return self.target_s[tokens]
            return max(floor, line(tokens))

        return [
            forward(k + 1) + (self.round_overhead_s if k else self.plain_overhead_s)
            for k in range(max_k + 1)
        ]

    def draft_prefill_per_token(self) -> float:
        """The draft's prefill spread over the tokens a request emits (0 before measured):
        short answers pay it over few tokens. Small in the serve bench (2 ms over 37
        tokens, about 1% of a token's cost), larger with long prompts or a deeper draft."""
        if self.draft_prefill_s is None or not self.emitted_per_request:
            return 0.0
        return self.draft_prefill_s / self.emitted_per_request

    def snapshot(self, max_k: int) -> dict[str, Any]:
        verify = self.verify_costs(max_k)
        return {
            "draft_step_s": self.draft_step_s,
            "draft_prefill_s": self.draft_prefill_s,
            "emitted_per_request": self.emitted_per_request,
            "verify_s": None if verify is None else {str(k): s for k, s in enumerate(verify)},
            "measured_target_tokens": sorted(self.target_s),
            "round_overhead_s": self.round_overhead_s,
            "plain_overhead_s": self.plain_overhead_s,
        }


def _running_average(
    old: float | None, new: float, count: float, added: float = 1, ema: float = _COST_EMA
) -> float:
    """A measurement worth ``added`` units folded in, ``count`` units in all with it: a
    plain mean of the first ones (a first one taken while warming up weighs its share),
    then a running average that follows the traffic (weight ``ema`` per unit)."""
    if old is None:
        return new
    weight: float = max(1.0 - (1.0 - ema) ** added, added / count)
    return (1.0 - weight) * old + weight * new


def _weighted_line(points: Sequence[tuple[int, float, int]]) -> Callable[[int], float]:
    """Weighted least squares through ``(tokens, seconds, weight)``, slope at least 0 (flat
    through the weighted mean when the points fall, or with a single token count)."""
    total = sum(w for _, _, w in points)
    mean_n = sum(n * w for n, _, w in points) / total
    mean_s = sum(s * w for _, s, w in points) / total
    spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    covariance = sum(w * (n - mean_n) * (s - mean_s) for n, s, w in points)
    slope = max(0.0, covariance / spread) if spread else 0.0
    return lambda tokens: mean_s + slope * (tokens - mean_n)


@dataclasses.dataclass
class _LastRequest:
    """The last request at a k, as :meth:`RealizedRates._pair` pairs it."""

    number: int  # observed requests up to and including it
    rate: float  # tokens/s
    units: float = 1.0  # its tokens over its k's running mean: what its pair weighs
    paired: bool = False  # with another request already


class RealizedRates:
    """Output tokens per second that each k really delivered, decoding and the draft's
    prefill included (running averages): the check on :func:`choose_k`'s model.

    A k's figure counts once ``MIN_REALIZED`` requests measured it, as their plain mean
    at first (an early request that paid for warming up must not dominate), then as a
    running average; plain decoding's counts after one. Requests weigh by their tokens,
    as in throughput: the figure is running seconds over running tokens, and a pair
    weighs as its speculative request's tokens over that k's mean.

    The machine's load moves every figure, but only the served k's figure follows it: a
    k served during a busy spell looked worse than another measured while the machine was
    quiet, and the choice moved to it (the serve bench served a draft that lost to plain
    decoding for 7 requests so). So each k is also compared with plain decoding pair by
    pair, requests at most ``_PAIR_WITHIN`` apart (see :meth:`_pair`). The log of each
    pair's ratio goes into a running average, where the load cancels; once ``MIN_REALIZED``
    requests at k made ``MIN_REALIZED`` pairs, it is one of the two readings the veto takes
    the lower of (:meth:`relative`). A served k with
    too few pairs, or whose own rate fell by more than ``_DRIFT`` since its last pair, is
    the controller's cue to serve plain decoding next (:meth:`pair_now`).
    """

    def __init__(self) -> None:
        self.seconds_per_token: dict[int, float] = {}
        self.requests: dict[int, int] = {}
        # k -> running averages of a request's seconds and tokens: their ratio is the rate
        # by tokens, as throughput is (a short request pays the draft's prefill over few
        # tokens; counted as one request each, a fitted draft's short answers read k=4 at
        # 0.97 of plain decoding where it served 1.19x side by side)
        self._seconds: dict[int, float] = {}
        self._tokens: dict[int, float] = {}
        self.log_ratio: dict[int, float] = {}  # k -> running average of log(k's rate / plain's)
        self.pairs: dict[int, int] = {}
        self._last: dict[int, _LastRequest] = {}
        self._paired_at: dict[int, float] = {}  # k -> its seconds per token at its last pair
        self._pair_weight: dict[int, float] = {}  # k -> pairs its average weighs as (by tokens)
        self._falling: set[int] = set()  # k's whose next pair may confirm a fall
        self._observed = 0

    @staticmethod
    def counts(timings: RoundTimings) -> bool:
        """Does the request count in the rates: did decoding emit tokens in measured time,
        all of them at its k (not a probe)?"""
        return bool(timings.emitted) and timings.decode_seconds > 0 and not timings.probe

    def observe(self, timings: RoundTimings) -> None:
        if not self.counts(timings):
            return
        seconds = timings.decode_seconds + timings.draft_prefill_seconds
        k = timings.k
        count = self.requests.get(k, 0) + 1
        self._seconds[k] = _running_average(self._seconds.get(k), seconds, count)
        self._tokens[k] = _running_average(self._tokens.get(k), timings.emitted, count)
        self.seconds_per_token[k] = self._seconds[k] / self._tokens[k]
        self.requests[k] = count
        self._observed += 1
        rate, units = timings.emitted / seconds, timings.emitted / self._tokens[k]
        paired = self._pair(k, rate, units)
        self._last[k] = _LastRequest(self._observed, rate, units, paired)

    def _pair(self, k: int, rate: float, units: float) -> bool:
        """Fold in the pairs this request makes with the last requests at other k's not
        paired yet, and say whether it made one (a request pairs once: a lucky one paired
        with each of the next three plain requests had 59% of the average): a plain
        request with each of them; a request at k with the last plain one, else with the
        last at the k served most (more than k), through that k's own ratio to plain (an
        exploration while speculating: else a k explored while plain decoding lost kept
        its old ratio for good)."""
        recent = {
            other: last
            for other, last in self._last.items()
            if other != k and not last.paired and self._observed - last.number <= _PAIR_WITHIN
        }
        if not k:
            for other, last in recent.items():
                self._fold(other, math.log(last.rate / rate), last, last.units)
            return bool(recent)
        if 0 in recent:
            self._fold(k, math.log(rate / recent[0].rate), recent[0], units)
            return True
        anchors = [
            other
            for other in recent
            if other in self.log_ratio and self.requests[other] > self.requests[k]
        ]
        if not anchors:
            return False
        anchor = max(anchors, key=lambda other: self.requests[other])
        log_ratio = math.log(rate / recent[anchor].rate) + self.log_ratio[anchor]
        self._fold(k, log_ratio, recent[anchor], units)
        return True

    def _fold(self, k: int, log_ratio: float, earlier: _LastRequest, units: float) -> None:
        """One pair into k's running average; where the pair confirms a fall that
        :meth:`pair_now` saw coming (below the average by ``_CONFIRMED_FALL``), the average
        so far is worth one mean-sized request's pair (the traffic or the draft changed: a
        k at 2.9x plain decoding that fell to 0.8x took 30 pairs to be vetoed, each pair
        worth a fifth). A pair weighs ``units``: its speculative request's tokens over
        that k's running mean."""
        earlier.paired = True
        old = self.log_ratio.get(k)
        fell = k in self._falling and old is not None and log_ratio < old - _CONFIRMED_FALL
        self._falling.discard(k)
        weight = 1 + units if fell else self._pair_weight.get(k, 0) + units
        self.log_ratio[k] = _running_average(old, log_ratio, weight, units)
        self._pair_weight[k] = weight
        self.pairs[k] = self.pairs.get(k, 0) + 1
        self._paired_at[k] = self.seconds_per_token[k]

    def pair_now(self, k: int) -> bool:
        """Should the next request decode plainly, to pair with the served ``k``? While k
        has fewer than ``MIN_REALIZED`` pairs (a choice that moved from another k pairs only
        at plain explorations, one in up to 128 requests: its figure was read off stale
        running rates), and when k's own rate fell by more than ``_DRIFT`` since its last
        pair (a draft whose prefill grew with the prompts was served 150 requests after it
        fell to 0.8x plain decoding). Only while k's last request is recent and unpaired:
        else the cue would serve plain for good. After a fall, the plain request pairs
        with k's next request, not with the slow one that set the cue off (such pairs read
        16% low, and load spells wiped out a 1.3x draft's history)."""
        last = self._last.get(k)
        if last is None or last.paired or self._observed - last.number >= _PAIR_WITHIN:
            return False
        if self.pairs.get(k, 0) < MIN_REALIZED:
            return True
        then, now = self._paired_at.get(k), self.seconds_per_token.get(k)
        if then is None or now is None or math.log(now / then) <= _DRIFT:
            return False
        last.paired = True
        self._falling.add(k)
        return True

    def tokens_per_s(self, k: int) -> float | None:
        """The realized rate at ``k``, once measured on enough requests to count."""
        enough = 1 if k == 0 else MIN_REALIZED
        seconds = self.seconds_per_token.get(k)
        return 1.0 / seconds if seconds and self.requests.get(k, 0) >= enough else None

    def relative(self, k: int) -> float | None:
        """What ``k`` delivered over what plain decoding delivered (1.0 at par), the lower
        of two readings that err in different ways: the pairs (once ``MIN_REALIZED``
        requests at k made as many), which the load cancels in but which are few and
        noisy while k is served (a 0.92x draft read 1.17x on its first four and was served
        for hundreds of requests), and the two running rates, each current where it is
        served but the other's stale through a busy spell. Serving plain decoding where
        one of them is wrong costs a few requests; serving a draft that loses, until the
        next exploration."""
        if k == 0:
            return 1.0
        readings = [] if (paired := self.paired(k)) is None else [paired]
        rate, plain = self.tokens_per_s(k), self.tokens_per_s(0)
        if rate is not None and plain is not None:
            readings.append(rate / plain)
        return min(readings, default=None)

    def paired(self, k: int) -> float | None:
        """k's rate over plain decoding's from its pairs, once ``MIN_REALIZED`` requests at
        k made as many; else None."""
        if min(self.pairs.get(k, 0), self.requests.get(k, 0)) < MIN_REALIZED:
            return None
        return math.exp(self.log_ratio[k])

    def veto(self, k: int, expected: Mapping[int, float] | None = None) -> int:
        """``k`` unless it did not beat plain decoding: as served (:meth:`relative`), or
        where it has no figure of its own yet, as ``expected`` (k -> ratio to plain
        decoding) says; then the best measured k that did, else 0. (The model's choice
        already had to beat plain decoding by ``min_gain``; what was served has only to
        beat it: per-request rates are noisy, and a veto of a k that pays costs as much
        as serving one that does not.)"""
        if k == 0 or self.tokens_per_s(0) is None:
            return k

        def pays(candidate: int) -> bool:
            ratio = self.relative(candidate)
            if ratio is None and expected is not None:
                ratio = expected.get(candidate)
            return ratio is None or ratio > 1.0

        if pays(k):
            return k
        measured = [c for c in self.seconds_per_token if c and self.relative(c) and pays(c)]
        return max(measured, key=self._ranking, default=0)

    def _ranking(self, k: int) -> float:
        """How the k's that pay rank: by their pairs where they have enough (a k served
        through a busy spell kept a loaded running rate, and a worse k measured before it
        was served for hundreds of requests in its place), else by :meth:`relative`."""
        paired = self.paired(k)
        return paired if paired is not None else self.relative(k) or 0.0

    def forget_speculation(self) -> None:
        """A new draft: what speculation delivered no longer holds (plain's rate does)."""
        self.seconds_per_token = {k: s for k, s in self.seconds_per_token.items() if k == 0}
        self._seconds = {k: s for k, s in self._seconds.items() if k == 0}
        self._tokens = {k: n for k, n in self._tokens.items() if k == 0}
        self.requests = {k: n for k, n in self.requests.items() if k == 0}
        self._last = {k: last for k, last in self._last.items() if k == 0}
        self.log_ratio.clear()
        self.pairs.clear()
        self._paired_at.clear()
        self._pair_weight.clear()
        self._falling.clear()

    def snapshot(self) -> dict[str, float]:
        return {
            str(k): rate for k in sorted(self.seconds_per_token) if (rate := self.tokens_per_s(k))
        }

    def relative_snapshot(self) -> dict[str, float]:
        return {
            str(k): ratio
            for k in sorted(self.seconds_per_token)
            if k and (ratio := self.relative(k)) is not None
        }


@dataclasses.dataclass
class _Countdown:
    """A segment's exploration pace since its choice last moved."""

    choice: int  # the k chosen when the countdown started
    interval: int  # requests between explorations now
    # The choice it moved from, served again after RECHECK_AFTER requests: a choice moves
    # when the figures of the k it served grow worse, and that is often the machine's load,
    # which the other k's older figures never saw. Measured under the same load, the old
    # choice wins back where the move was the load's doing.
    previous: int | None = None
    left: int = dataclasses.field(init=False)  # requests until the next exploration
    turns: int = 0  # explorations since the choice

    def __post_init__(self) -> None:
        self.left = self.interval if self.previous is None else RECHECK_AFTER


class AcceptanceEstimate:
    """Per-position conditional acceptance of chain drafting, with decaying counts.

    A round that drafted d tokens and had m accepted tried positions 0..min(m, d - 1):
    positions before m were accepted, position m (when m < d) was rejected; positions
    after it say nothing. Counts decay by ``decay`` per round so the estimate follows
    the traffic.
    """

    def __init__(self, max_k: int, decay: float) -> None:
        self.trials = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self.decay = decay
        self.rounds = 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.trials = [t * self.decay for t in self.trials]
        self.accepted = [a * self.decay for a in self.accepted]
        for position in range(min(accepted + 1, drafted, len(self.trials))):
            self.trials[position] += 1.0
            self.accepted[position] += 1.0 if position < accepted else 0.0

    def rates(self, prior: Sequence[float] | None, prior_rounds: float) -> list[float]:
        """Smoothed rates: towards ``prior`` if given, else towards the previous position."""
        rates: list[float] = []
        for position, (tried, accepted) in enumerate(zip(self.trials, self.accepted, strict=True)):
            previous = rates[-1] if rates else 1.0
            toward = prior[position] if prior is not None else previous
            rates.append((accepted + prior_rounds * toward) / (tried + prior_rounds))
        return rates


class KController:
    """Picks each request's k and learns from what the request measured.

    ``adaptive`` off: every request runs at ``max_k`` (0 with ``speculative`` off), and
    the controller still measures and reports the k it would choose. Thread-safe: the
    worker picks and observes, the HTTP server reads :meth:`snapshot`.
    """

    def __init__(
        self,
        max_k: int,
        *,
        adaptive: bool,
        speculative: bool = True,
        explore_every: int = 16,
        min_gain: float = DEFAULT_MIN_GAIN,
        decay: float = 0.995,
        probe_rounds: int = 8,
    ) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.speculative = speculative
        self.explore_every = explore_every
        self.min_gain = min_gain
        self.decay = decay
        self.probe_rounds = probe_rounds
        self.costs = CostModel()
        self._lock = threading.Lock()
        self._overall = AcceptanceEstimate(max_k, decay)
        self._segments: OrderedDict[str, AcceptanceEstimate] = OrderedDict()
        self._exploring: dict[str | None, _Countdown] = {}  # per segment (None: unlabelled)
        self.requests_by_k = [0] * (max_k + 1)
        self.probes = 0  # of those, requests speculated for probe_rounds rounds only
        self.realized = RealizedRates()
        # k -> what the model expected of the requests served at k: a running average of
        # log(k's rate / plain decoding's), beside what they delivered (realized)
        self._modelled: dict[int, float] = {}
        self.calibrated = False

    def calibrate(self, probes: Iterable[RoundTimings]) -> None:
        """Costs from probe generations run before serving, one per k: the first requests
        are then served at a k chosen from measured costs instead of measuring them (each
        token count read by a probe's every round, not by a request's short last verify).
        Acceptance and realized rates are left alone: a probe's prompt is no traffic."""
        measured = list(probes)  # generated before the lock: /metrics reads under it
        with self._lock:
            for timings in measured:
                self.costs.observe(timings)
            self.calibrated = True

    # -- estimates -------------------------------------------------------------------------

    def acceptance(self, segment: str | None = None) -> list[float]:
        with self._lock:
            return self._acceptance(segment)

    def _acceptance(self, segment: str | None) -> list[float]:
        overall = self._overall.rates(None, _PRIOR_ROUNDS)
        estimate = self._segments.get(segment) if segment is not None else None
        if estimate is None:
            return overall
        return estimate.rates(overall, _SEGMENT_PRIOR_ROUNDS)

    def _choice(self, segment: str | None) -> KChoice | None:
        verify = self.costs.verify_costs(self.max_k)
        draft = self.costs.draft_step_s
        if verify is None or draft is None:
            return None
        return choose_k(
            self._acceptance(segment),
            draft,
            verify,
            max_k=self.max_k,
            min_gain=self.min_gain,
            draft_prefill_s_per_token=self.costs.draft_prefill_per_token(),
        )

    def _served_choice(self, segment: str | None) -> tuple[KChoice | None, int, int]:
        """The model's choice, its k (the largest k before costs are measured) and the k
        served for it: the model's k unless it did not pay as served or, with no figure
        of its own yet (fewer than ``MIN_REALIZED`` requests), as the model expects it once
        corrected by its error on the k's that have one (:meth:`_model_error`).
        Uncorrected, the demo's adapted draft served k=4 at 0.81x plain decoding where the
        model expected 1.19x; the model then expected k=2 and k=3 to pay 1.29x and 1.15x,
        and each was served until it had figures of its own (0.94x, 0.83x): 18 of 54 timed
        requests, 0.95x plain in all."""
        choice = self._choice(segment)
        modelled = choice.k if choice is not None else self.max_k
        return choice, modelled, self.realized.veto(modelled, self._corrected(choice))

    def _corrected(self, choice: KChoice | None) -> dict[int, float] | None:
        """Each k's expected rate over plain decoding's, times the model's error."""
        error = self._model_error()
        if choice is None or error is None:
            return None
        plain = choice.tokens_per_s[0]
        return {k: rate / plain * error for k, rate in enumerate(choice.tokens_per_s) if k}

    def _model_error(self) -> float | None:
        """What the served k's delivered over what the model expected of them, as one
        factor: the mean of their log-ratios, each k weighed by its requests; None before
        a k has a realized figure. What a k delivered is read from its pairs with plain
        decoding where it has enough (the machine's load cancels in them), else as the
        veto reads it (:meth:`RealizedRates.relative`, the lower of two readings: in one
        serve bench it read a fitted draft's k=4 at 0.80x plain decoding, where the timed
        pass served mostly at k=4 measured 1.15x, and the error at 0.64). The
        model misses costs it does not see (a request's last round cut short by its end,
        the first verify), which weigh on every k, if not exactly alike."""
        total, weight = 0.0, 0
        for k, expected in self._modelled.items():
            ratio = self.realized.paired(k) or self.realized.relative(k)
            if ratio is not None and ratio > 0:
                requests = self.realized.requests[k]
                total += requests * (math.log(ratio) - expected)
                weight += requests
        return math.exp(total / weight) if weight else None

    def _expect(self, timings: RoundTimings, segment: str | None) -> None:
        """Folds what the model expects of the request's k into ``_modelled`` (a running
        average over the requests :class:`RealizedRates` counts, by request where it
        weighs by tokens). Not while acceptance is unmeasured (the first request after
        calibration or a swap): every position then reads 1.0, and the demo draft's k=4
        would have been expected at 1.80x plain decoding instead of 1.10x."""
        if not timings.k or not self.realized.counts(timings) or not self._overall.rounds:
            return
        choice = self._choice(segment)
        if choice is None:
            return
        log_ratio = math.log(choice.tokens_per_s[timings.k] / choice.tokens_per_s[0])
        count = self.realized.requests.get(timings.k, 0) + 1
        old = self._modelled.get(timings.k)
        self._modelled[timings.k] = _running_average(old, log_ratio, count)

    # -- serving ---------------------------------------------------------------------------

    def pick(self, segment: str | None = None) -> int:
        """The k to serve the next request with (exploration included)."""
        return self.plan(segment).k

    def plan(self, segment: str | None = None) -> KPlan:
        """How to serve the next request: its k, and whether it is a probe. While the
        model itself chooses plain decoding, an exploration speculates its first
        ``probe_rounds`` rounds only: it measures acceptance and costs, which is what it
        is for, at the price of a few rounds instead of a whole request. Where the
        realized rates vetoed the model's k, explorations are served whole: the k the
        veto falls back on must have delivered a figure of its own."""
        with self._lock:
            k, probe = self._pick(segment)
            self.requests_by_k[k] += 1
            probe = probe and self.probe_rounds > 0
            self.probes += probe
            return KPlan(k, self.probe_rounds if probe else None)

    def _pick(self, segment: str | None) -> tuple[int, bool]:
        """``(k, whether the request is a probe)``."""
        if not self.speculative:
            return 0, False
        if not self.adaptive:
            return self.max_k, False
        measuring = self._measuring()
        if measuring is not None:
            return measuring, False
        choice, modelled, chosen = self._served_choice(segment)
        explored = self._explored(segment, chosen, modelled)
        if explored is None and chosen and self.realized.pair_now(chosen):
            explored = 0  # the served k needs a pair with plain decoding
        k = chosen if explored is None else explored
        if logger.isEnabledFor(logging.DEBUG):  # the figures are formatted per request
            logger.debug(
                "segment %s: k=%d (model %d, served choice %d, %s; expected tokens/s %s)",
                segment,
                k,
                modelled,
                chosen,
                "exploring" if explored is not None else "not exploring",
                None if choice is None else [round(rate, 1) for rate in choice.tokens_per_s],
            )
        # a probe only where nothing vetoed the model: a vetoed choice falls back on a k
        # with a realized figure, which a probe never gives its k
        return k, explored is not None and chosen == modelled == 0 and k != 0

    def _measuring(self) -> int | None:
        """The k every request runs at while what the choice rests on is measured, else
        None: the largest k until the draft and every position are, then plain decoding
        until a plain request measured the rate to beat as it is now (a calibration probe
        on a busy machine measured plain decoding at 148 tokens/s where it served 180,
        and a draft that lost to it was served 15 requests)."""
        if self.costs.draft_step_s is None or not self._overall.rounds:
            return self.max_k
        if self.realized.tokens_per_s(0) is None:
            return 0
        return None

    def _exploration(self, chosen: int, modelled: int, turn: int) -> int:
        """The k an exploring request runs at: the model's k every other turn where the
        realized rates overrule it (what it still expects to pay is measured again);
        otherwise, in turn, plain decoding while speculating (the rate speculation must
        beat: measured by calibration on a busy machine, a plain step's cost stayed
        stale while only k >= 2 was served and its neighbours explored) and the
        neighbours of the choice."""
        vetoed = modelled != chosen
        if vetoed and turn % 2 == 0:
            return modelled
        up, down = min(chosen + 1, self.max_k), max(chosen - 1, 0)
        turns = [0] if chosen else []
        turns += [k for k in (down, up) if k not in (chosen, modelled) and k not in turns]
        if not turns:
            return modelled if vetoed else chosen
        return turns[(turn // 2 if vetoed else turn) % len(turns)]

    def _explored(self, segment: str | None, chosen: int, modelled: int) -> int | None:
        """The k this request explores at, else None: on the segment's countdown, which
        doubles while the choice holds and starts over when it moves, the old choice
        served again soon after a move (see :class:`_Countdown`).

        Labels past the first ``MAX_SEGMENTS`` share the unlabelled countdown: clearing
        or evicting countdowns for them restarted each before it ran out, and with more
        labels than that taking turns, no request explored. Their choices differ, so
        another choice there is no move of one label's choice: the countdown runs on (it
        restarted whenever two of them alternated, and none explored) and nothing is
        served again for the label before."""
        shared = segment is not None and segment not in self._exploring
        shared = shared and len(self._exploring) >= MAX_SEGMENTS
        if shared:
            segment = None
        state = self._exploring.get(segment)
        if state is None or (state.choice != chosen and not shared):
            previous = None if state is None else state.choice
            state = self._exploring[segment] = _Countdown(chosen, self.explore_every, previous)
        state.left -= 1
        if state.left > 0:
            return None
        if state.previous is not None:
            recheck, state.previous, state.left = state.previous, None, state.interval
            return recheck
        # Vetoed, the model's k is served at every other exploration: one in 128 requests
        # kept a draft at 1.13x plain decoding on plain for 500 requests after one noisy pair.
        limit = _VETOED_BACKOFF_LIMIT if modelled != chosen else _EXPLORE_BACKOFF_LIMIT
        state.interval = min(state.interval * 2, self.explore_every * limit)
        state.left = state.interval
        state.turns += 1
        return self._exploration(chosen, modelled, state.turns - 1)

    def observe(self, timings: RoundTimings, segment: str | None = None) -> None:
        with self._lock:
            self._expect(timings, segment)  # before this request's costs move the model
            self.costs.observe(timings)
            self.realized.observe(timings)
            estimates = [self._overall]
            if segment is not None:
                estimate = self._segments.pop(segment, None) or AcceptanceEstimate(
                    self.max_k, self.decay
                )
                self._segments[segment] = estimate  # most recent last
                while len(self._segments) > MAX_SEGMENTS:
                    self._segments.popitem(last=False)
                estimates.append(estimate)
            for drafted, accepted in timings.rounds:
                for estimate in estimates:
                    estimate.observe(drafted, accepted)
            if logger.isEnabledFor(logging.DEBUG):  # the snapshot is built per request
                logger.debug(
                    "served at k=%d: %d tokens in %.4f s decoding; realized tokens/s %s",
                    timings.k,
                    timings.emitted,
                    timings.decode_seconds + timings.draft_prefill_seconds,
                    {k: round(rate, 1) for k, rate in self.realized.snapshot().items()},
                )

    def draft_swapped(self) -> None:
        """A new draft: acceptance starts over (costs stay: same target, same draft shape)."""
        with self._lock:
            self._overall = AcceptanceEstimate(self.max_k, self.decay)
            self._segments.clear()
            self._exploring.clear()  # explore at the first pace again
            self.realized.forget_speculation()
            self._modelled.clear()

    # -- reporting -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The choice, its expected tokens/s, the costs and acceptance (JSON-safe)."""
        with self._lock:
            overall = self._describe(None)
            segments = {name: self._describe(name) for name in self._segments}
            return {
                "adaptive": self.adaptive,
                "max_k": self.max_k,
                "calibrated": self.calibrated,
                **overall,
                "costs": self.costs.snapshot(self.max_k),
                "realized_tokens_per_s": self.realized.snapshot(),
                "realized_vs_plain": self.realized.relative_snapshot(),
                "model_error": self._model_error(),
                "requests_by_k": {str(k): n for k, n in enumerate(self.requests_by_k)},
                "probes": self.probes,
                "segments": segments,
            }

    def _describe(self, segment: str | None) -> dict[str, Any]:
        """What the segment is served at now, exploration aside (as :meth:`_pick`), and why."""
        choice, _, served = self._served_choice(segment)
        recommended = None if choice is None else served
        if not self.speculative:
            serving = 0
        elif not self.adaptive:
            serving = self.max_k
        else:
            measuring = self._measuring()
            serving = served if measuring is None else measuring
        return {
            "chosen_k": serving,
            "recommended_k": recommended,
            "modelled_k": choice.k if choice is not None else None,
            "expected_tokens_per_s": None
            if choice is None
            else {str(k): _finite(rate) for k, rate in enumerate(choice.tokens_per_s)},
            "acceptance": [round(rate, 6) for rate in self._acceptance(segment)],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None

"""The benches' paired reading of one engine's tokens/s against another's, and the order
they serve each prompt in."""

from __future__ import annotations

import itertools

import pytest

from tide_lib.harness.serve_bench import EngineRun, paired_ratio, turn_orders


def _runs(mine: list[float], theirs: list[float]) -> dict[str, EngineRun]:
    return {
        "adaptive": EngineRun(request_tokens_per_s=mine),
        "plain": EngineRun(request_tokens_per_s=theirs),
    }


def test_a_steady_gain_is_told_from_parity_and_noise_is_not() -> None:
    """Every request 5% faster: bounds above 1. Requests up and down by 5%: the bounds
    hold 1.0, whatever the mean says."""
    plain = [100.0, 120.0, 90.0, 110.0, 105.0, 95.0]
    steady = paired_ratio(_runs([r * 1.05 for r in plain], plain), "adaptive", "plain")
    assert steady["ratio"] == pytest.approx(1.05) and steady["low"] > 1.0
    assert steady["requests"] == len(plain)
    swings = [r * (1.05 if i % 2 else 0.96) for i, r in enumerate(plain)]
    noisy = paired_ratio(_runs(swings, plain), "adaptive", "plain")
    assert noisy["low"] < 1.0 < noisy["high"]


def test_too_few_requests_give_no_reading() -> None:
    assert paired_ratio(_runs([100.0], [90.0]), "adaptive", "plain") == {}


@pytest.mark.parametrize("engines", [2, 3, 4, 5])
def test_no_engine_serves_twice_in_a_row_and_each_follows_every_other(engines: int) -> None:
    names = [f"e{i}" for i in range(engines)]
    orders = turn_orders(names, 60)
    assert all(sorted(order) == names for order in orders)
    served = [name for order in orders for name in order]
    assert all(a != b for a, b in itertools.pairwise(served))
    followed = {(a, b) for a, b in itertools.pairwise(served)}
    assert followed == {(a, b) for a in names for b in names if a != b}
    assert turn_orders(names, 60) == orders  # the same on every run

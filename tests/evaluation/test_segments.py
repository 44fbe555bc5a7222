"""The segmenter (issue 14): clusters of the target's own states name unlabelled traffic."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from tide_lib.evaluation.segments import (
    Segmenter,
    fit_segmenter,
    segment_as_grouped,
    segment_of,
)
from tide_lib.lake.schema import CapturedRecord

HIDDEN = 32


def _sample(
    name: str, center: np.ndarray, rng: np.random.Generator, **kw: object
) -> CapturedRecord:
    tokens = int(rng.integers(6, 14))
    states = center[None] + 0.3 * rng.standard_normal((tokens, HIDDEN))
    return CapturedRecord(
        request_id=name,
        target_id="t",
        draft_version="v1",
        started_at=datetime.now(UTC),
        finished_at=datetime.now(UTC),
        input_ids=torch.arange(tokens),
        loss_mask=torch.ones(tokens, dtype=torch.long),
        hidden_states=torch.from_numpy(states).half(),
        aux_hidden_states=torch.zeros(tokens, 3 * HIDDEN, dtype=torch.half),
        spec_verify_ct=1,
        spec_accept_tokens=1,
        **kw,  # type: ignore[arg-type]
    )


def _centers(count: int, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [3.0 * rng.standard_normal(HIDDEN) for _ in range(count)]


def _traffic(counts: dict[int, int], seed: int = 0) -> list[tuple[int, CapturedRecord]]:
    rng, centers = np.random.default_rng(seed), _centers(4)
    return [
        (group, _sample(f"g{group}-{i}", centers[group], rng))
        for group, count in counts.items()
        for i in range(count)
    ]


def _partition(
    segmenter: Segmenter, traffic: list[tuple[int, CapturedRecord]]
) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for group, sample in traffic:
        found.setdefault(group, set()).add(segmenter.assign(sample))
    return found


def test_two_synthetic_clusters_are_told_apart() -> None:
    traffic = _traffic({0: 30, 1: 30})
    segmenter = fit_segmenter([s for _, s in traffic], num_clusters=2, min_share=0.1)
    names = _partition(segmenter, traffic)
    assert len(names[0]) == 1 and len(names[1]) == 1  # each group is one segment
    assert names[0] != names[1]  # and the two differ
    again = fit_segmenter([s for _, s in traffic], num_clusters=2, min_share=0.1)
    assert _partition(again, traffic) == names  # deterministic


def test_names_stay_stable_when_refit_from_the_previous_centroids() -> None:
    first_traffic = _traffic({0: 30, 1: 30}, seed=0)
    first = fit_segmenter([s for _, s in first_traffic], num_clusters=2, min_share=0.1)
    names = _partition(first, first_traffic)
    # The next cycle: other requests of the same traffic, in another order and mix.
    later = _traffic({1: 40, 0: 10}, seed=1)[::-1]
    refit = fit_segmenter(
        [s for _, s in later],
        num_clusters=2,
        min_share=0.1,
        previous=Segmenter.from_json(first.to_json()),
    )
    assert _partition(refit, later) == names
    assert refit.cluster_ids == first.cluster_ids


def test_a_new_cluster_gets_a_new_name_and_old_ones_keep_theirs() -> None:
    old = _traffic({0: 30, 1: 30}, seed=0)
    first = fit_segmenter([s for _, s in old], num_clusters=2, min_share=0.1)
    grown = _traffic({0: 20, 1: 20, 2: 20}, seed=2)
    refit = fit_segmenter([s for _, s in grown], num_clusters=3, min_share=0.1, previous=first)
    names = _partition(refit, grown)
    assert names[0] == _partition(first, old)[0] and names[1] == _partition(first, old)[1]
    assert names[2].isdisjoint(names[0] | names[1])


def test_a_refit_that_merges_clusters_renames_none_of_the_traffic_that_stayed_together() -> None:
    """Issue 55: a segment's identity survives a refit. Group 1 was one segment of two
    clusters, named ``cluster-2`` by an earlier fit; merged again, the lowest id would
    rename it ``cluster-1``, a renaming a check would read as new traffic."""
    traffic = _traffic({0: 40, 1: 40})
    centers = [c / np.linalg.norm(c) for c in _centers(4)[:2]]
    near = centers[1] + 0.01 * np.ones(HIDDEN)
    previous = Segmenter(
        np.stack([centers[0], centers[1], near / np.linalg.norm(near)]),
        (0, 1, 2),
        ("cluster-0", "cluster-2", "cluster-2"),
        (0.5, 0.25, 0.25),
    )
    refit = fit_segmenter([s for _, s in traffic], num_clusters=3, min_share=0.1, previous=previous)
    kept = {
        group: sum(refit.assign(s) == previous.assign(s) for g, s in traffic if g == group) / 40
        for group in (0, 1)
    }
    assert kept[0] >= 0.9 and kept[1] >= 0.9, kept
    assert set(refit.segment_of_cluster) <= {"cluster-0", "cluster-2"}


def test_a_segment_that_matches_none_never_takes_a_name_in_use_or_gone() -> None:
    """Group 2 is new traffic; the name its lowest cluster id gives it (``cluster-1``) was
    a previous segment's, whose figures are not this traffic's: it gets a fresh one."""
    traffic = _traffic({0: 40, 2: 40})
    centers = [c / np.linalg.norm(c) for c in _centers(4)]
    previous = Segmenter(np.stack([centers[0]]), (0,), ("cluster-1",), (1.0,))
    refit = fit_segmenter([s for _, s in traffic], num_clusters=2, min_share=0.1, previous=previous)
    names = _partition(refit, traffic)
    assert names[0] == {"cluster-1"}  # the old traffic keeps its name
    assert len(names[2]) == 1 and names[2].isdisjoint({"cluster-0", "cluster-1"})


def test_a_cluster_under_the_minimum_share_is_not_its_own_segment() -> None:
    traffic = _traffic({0: 40, 1: 40, 2: 3})  # group 2: a sliver of the tokens
    # Started at the three groups (as a previous cycle that saw them would be).
    centers = np.stack([c / np.linalg.norm(c) for c in _centers(4)[:3]])
    previous = Segmenter(centers, (0, 1, 2), ("cluster-0", "cluster-1", "cluster-2"), (0.4,) * 3)
    fitted = fit_segmenter(
        [s for _, s in traffic], num_clusters=3, min_share=0.1, previous=previous
    )
    names = _partition(fitted, traffic)
    assert fitted.shares[2] < 0.1
    assert len(set().union(*names.values())) == 2  # three clusters, two segments
    assert names[2] <= names[0] | names[1]  # the sliver counts for a larger one
    kept = fit_segmenter([s for _, s in traffic], num_clusters=3, min_share=0.01, previous=previous)
    assert len(set().union(*_partition(kept, traffic).values())) == 3


def test_one_kind_of_traffic_cut_in_pieces_is_one_segment() -> None:
    traffic = _traffic({0: 60})
    fitted = fit_segmenter([s for _, s in traffic], num_clusters=3, min_share=0.05)
    assert fitted.num_clusters == 3  # k-means made three clusters of one blob...
    assert len(set(fitted.segment_of_cluster)) == 1  # ...which are one segment


def test_client_labels_win_and_are_not_clustered() -> None:
    rng, centers = np.random.default_rng(3), _centers(2)
    labelled = [_sample(f"l{i}", centers[0], rng, segment="law") for i in range(20)]
    unlabelled = [_sample(f"u{i}", centers[1], rng) for i in range(20)]
    fitted = fit_segmenter([*labelled, *unlabelled], num_clusters=2, min_share=0.1)
    assert fitted.fitted_on == 20
    assert {segment_of(s, fitted) for s in labelled} == {"law"}
    assert all(segment_of(s, fitted).startswith("cluster-") for s in unlabelled)


def test_labels_beyond_the_cap_are_clustered_and_the_cap_survives_storage() -> None:
    """A client that sends many labels gets at most max_labels segments (most tokens first);
    the requests of the others are clustered as unlabelled traffic."""
    rng, centers = np.random.default_rng(4), _centers(3)
    big = [_sample(f"b{i}", centers[0], rng, segment="law") for i in range(20)]
    small = [_sample(f"s{i}", centers[1], rng, segment=f"ticket {i}") for i in range(10)]
    plain = [_sample(f"u{i}", centers[2], rng) for i in range(20)]
    fitted = fit_segmenter([*big, *small, *plain], num_clusters=2, min_share=0.1, max_labels=1)
    assert fitted.labels == ("law",) and fitted.fitted_on == 30
    stored = Segmenter.from_json(fitted.to_json())
    assert {segment_of(s, stored) for s in big} == {"law"}
    for group in (small, plain):
        names = {segment_of(s, stored) for s in group}
        assert len(names) == 1 and names.pop().startswith("cluster-")
    assert segment_of(small[0], stored) != segment_of(plain[0], stored)
    legacy = b'{"format": 1, "centroids": [], "cluster_ids": [], "segment_of_cluster": [], '
    legacy += b'"shares": []}'
    assert Segmenter.from_json(legacy).keeps("anything")  # stored before the cap: all kept


def test_an_older_grouping_keeps_its_clusters_and_a_new_label_is_its_own_segment() -> None:
    """The drift check groups a window as the champion's baseline was grouped; a label
    that arrived since (new traffic) is its own segment, not lumped into a cluster."""
    rng, centers = np.random.default_rng(5), _centers(3)
    english = [_sample(f"e{i}", centers[0], rng, segment="english") for i in range(20)]
    plain = [_sample(f"u{i}", centers[1], rng) for i in range(20)]
    korean = [_sample(f"k{i}", centers[2], rng, segment="korean") for i in range(20)]
    older = fit_segmenter([*english, *plain], num_clusters=1, min_share=0.1, max_labels=1)
    current = fit_segmenter([*korean, *plain], num_clusters=2, min_share=0.1, max_labels=1)
    assert not older.keeps("korean")  # to the older fit, korean would be a cluster
    assert {segment_as_grouped(s, older, current) for s in korean} == {"korean"}
    assert {segment_as_grouped(s, older, current) for s in plain} == {segment_of(plain[0], older)}
    assert {segment_as_grouped(s, older, current) for s in english} == {"english"}


@pytest.mark.parametrize("label", ["all", "ALL", "cluster-3", "Cluster-x"])
def test_tide_own_segment_names_are_refused_as_labels(label: str) -> None:
    from tide_lib.lake.schema import segment_problem

    problem = segment_problem(label)
    assert problem is not None and "reserved" in problem
    assert segment_problem("clusters of law") is None


def test_a_segmenter_of_another_hidden_size_says_to_refit() -> None:
    fitted = fit_segmenter([s for _, s in _traffic({0: 5})], num_clusters=1, min_share=0.1)
    other = CapturedRecord(
        "x",
        "t",
        "v1",
        datetime.now(UTC),
        datetime.now(UTC),
        torch.arange(3),
        torch.ones(3, dtype=torch.long),
        torch.zeros(3, 8, dtype=torch.half),
        torch.zeros(3, 24, dtype=torch.half),
        1,
        1,
    )
    with pytest.raises(ValueError, match="refit"):
        fitted.assign(other)


def test_a_segmenter_with_no_clusters_reads_back() -> None:
    """All traffic labelled: the cycle stores a segmenter without clusters, and every later
    step of the cycle (the export) reads it back."""
    from tide_lib.evaluation.segments import empty_segmenter

    empty = Segmenter.from_json(empty_segmenter().to_json())
    assert empty.num_clusters == 0


def test_copies_of_a_request_fall_on_the_same_side_of_the_held_out_split() -> None:
    """The cycle's held-out rule hashes the tokens, not the request id: the same prompt
    answered the same way by two requests is held out or trained on, never both."""
    from tide_lib.orchestration import export

    rng, center = np.random.default_rng(5), _centers(1)[0]
    sides = set()
    for index in range(200):
        sample = _sample(f"r{index}", center, rng)
        copy = dataclasses.replace(sample, request_id=f"copy-of-r{index}")
        assert export._held_out(sample, 20) == export._held_out(copy, 20)
        sides.add(export._held_out(sample, 20))
    assert sides == {True, False}

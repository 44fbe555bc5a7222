"""Traffic segments from the traffic itself: client labels, else clusters of the target's states.

The gate protects what the fleet serves, so segments must be traffic, not time
slices. A request a client labelled (``CapturedRecord.segment``) belongs to that
label. The rest are grouped by k-means on the mean-pooled final hidden states of
the target (its own view of the request: language, task, format), so no label is
needed for English chat and Korean law to be told apart.

Each cycle refits the clusters, warm-started from the previous cycle's centroids,
so cluster ``cluster-2`` stays the same traffic from cycle to cycle (a centroid no
request is nearest keeps its place). A cluster holding less than the minimum
token share is not its own segment: its requests count for the nearest larger
cluster, and clusters closer than their own spread (one kind of traffic that
k-means cut in pieces) are one segment. The fitted :class:`Segmenter` is small
(centroids and names) and is stored as JSON next to the cycle's state, so the
draft a cycle registers points at the segmenter its figures were measured with.
"""

from __future__ import annotations

__all__ = [
    "CLUSTER_PREFIX",
    "UNSEGMENTED",
    "Segmenter",
    "fit_segmenter",
    "pooled_state",
    "segment_as_grouped",
    "segment_of",
]

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from tide_lib.lake.schema import CLUSTER_PREFIX, UNSEGMENTED

if TYPE_CHECKING:
    from tide_lib.lake.schema import CapturedRecord

logger = logging.getLogger(__name__)

_MAX_ITERATIONS: Final = 100
_FORMAT_VERSION: Final = 1


def pooled_state(sample: CapturedRecord) -> np.ndarray:
    """The request as one point: its final hidden states averaged over tokens, unit length."""
    states: np.ndarray = sample.hidden_states.float().mean(dim=0).numpy().astype(np.float64)
    norm = float(np.linalg.norm(states))
    return states / norm if norm > 0 else states


@dataclasses.dataclass(frozen=True)
class Segmenter:
    """Cluster centroids of unlabelled traffic and the segment each cluster counts for.

    ``cluster_ids[i]`` names centroid ``i`` for good (``cluster-<id>``);
    ``segment_of_cluster[i]`` is the segment its requests count for: its own name,
    or that of the nearest larger cluster when its share is under the minimum.
    """

    centroids: np.ndarray  # [C, H] float64, unit-length rows
    cluster_ids: tuple[int, ...]
    segment_of_cluster: tuple[str, ...]
    shares: tuple[float, ...]  # token share of each cluster in the data it was fitted on
    fitted_on: int = 0  # requests
    labels: tuple[str, ...] | None = None  # client labels kept as segments; None: every one

    def keeps(self, label: str) -> bool:
        """Is ``label`` a segment of its own (else its requests are clustered)?"""
        return self.labels is None or label in self.labels

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_ids)

    def assign(self, sample: CapturedRecord) -> str:
        """The segment of an unlabelled request."""
        if self.num_clusters == 0:
            return UNSEGMENTED
        return self.segment_of_cluster[self._nearest(pooled_state(sample))]

    def _nearest(self, point: np.ndarray) -> int:
        if point.shape[0] != self.centroids.shape[1]:
            raise ValueError(
                f"a request of hidden size {point.shape[0]} met a segmenter fitted on hidden "
                f"size {self.centroids.shape[1]}: refit it on this target's traffic"
            )
        return int(np.argmin(_squared_distances(point[None], self.centroids)[0]))

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT_VERSION,
                "centroids": self.centroids.tolist(),
                "cluster_ids": list(self.cluster_ids),
                "segment_of_cluster": list(self.segment_of_cluster),
                "shares": list(self.shares),
                "fitted_on": self.fitted_on,
                "labels": list(self.labels) if self.labels is not None else None,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Segmenter:
        data: dict[str, Any] = json.loads(raw)
        if data.get("format") != _FORMAT_VERSION:
            raise ValueError(
                f"segmenter format {data.get('format')!r} is not {_FORMAT_VERSION}; "
                "refit it (a cycle that finds none fits a fresh one)"
            )
        centroids = np.asarray(data["centroids"], dtype=np.float64)
        ids = tuple(int(i) for i in data["cluster_ids"])
        if centroids.ndim != 2 and ids:
            raise ValueError(f"segmenter centroids have shape {centroids.shape}, expected [C, H]")
        labels = data.get("labels")  # absent in segmenters stored before labels were capped
        return cls(
            centroids=centroids.reshape(len(ids), -1) if ids else centroids.reshape(0, 0),
            cluster_ids=ids,
            segment_of_cluster=tuple(str(s) for s in data["segment_of_cluster"]),
            shares=tuple(float(s) for s in data["shares"]),
            fitted_on=int(data.get("fitted_on", 0)),
            labels=tuple(str(label) for label in labels) if labels is not None else None,
        )


def segment_of(sample: CapturedRecord, segmenter: Segmenter | None) -> str:
    """The client's label when the request has one the segmenter keeps, else its cluster."""
    if sample.segment is not None and (segmenter is None or segmenter.keeps(sample.segment)):
        return sample.segment
    return segmenter.assign(sample) if segmenter is not None else UNSEGMENTED


def segment_as_grouped(sample: CapturedRecord, grouping: Segmenter, current: Segmenter) -> str:
    """The segment of ``sample`` as an older segmenter (``grouping``) named
    it, so clusters mean the same requests on both sides; a client label this cycle's
    segmenter (``current``) keeps is its own segment whatever ``grouping`` knew (labels
    are the clients', stable across fits: a label that is new is new traffic)."""
    if sample.segment is not None and current.keeps(sample.segment):
        return sample.segment
    return segment_of(sample, grouping)


def fit_segmenter(
    samples: Iterable[CapturedRecord],
    *,
    num_clusters: int,
    min_share: float,
    max_labels: int = 16,
    previous: Segmenter | None = None,
    seed: int = 0,
) -> Segmenter:
    """Fit clusters on the unlabelled requests among ``samples``.

    Client labels are segments of their own, up to ``max_labels`` of them (the most
    tokens first): labels come from clients, and each segment costs the gate a check
    and the registry a tag, so the requests of any further label are clustered as if
    unlabelled.

    Token-weighted k-means (a long request weighs as its tokens), started from
    ``previous``'s centroids when it has the same hidden size, new centroids (if
    ``num_clusters`` grew) by k-means++ with ``seed``. Deterministic for the same
    inputs.
    """
    points, weights, owners = [], [], []
    label_tokens: dict[str, float] = {}
    for sample in samples:
        tokens = float(sample.input_ids.numel())
        if sample.segment is not None:
            label_tokens[sample.segment] = label_tokens.get(sample.segment, 0.0) + tokens
        points.append(pooled_state(sample))
        weights.append(tokens)
        owners.append(sample.segment)
    kept = tuple(sorted(label_tokens, key=lambda label: (-label_tokens[label], label))[:max_labels])
    if len(kept) < len(label_tokens):
        logger.warning(
            "%d client labels, at most %d kept as segments (%s); the requests of the others "
            "are clustered",
            len(label_tokens),
            max_labels,
            ", ".join(kept),
        )
    clustered = [i for i, owner in enumerate(owners) if owner is None or owner not in kept]
    points = [points[i] for i in clustered]
    weights = [weights[i] for i in clustered]
    if not points:
        base = previous or empty_segmenter()
        return dataclasses.replace(base, labels=kept)
    data, mass = np.stack(points), np.asarray(weights)
    usable = previous if previous is not None and _same_width(previous, data) else None
    ids, start = _initial(data, mass, num_clusters, usable, np.random.default_rng(seed))
    centroids, labels = _lloyd(data, mass, start)
    shares = np.bincount(labels, weights=mass, minlength=len(ids)) / mass.sum()
    names = _merge_small(centroids, ids, shares, min_share, _radii(data, mass, centroids, labels))
    if usable is not None:
        names = _kept_names(names, usable, shares, ids)
    segmenter = Segmenter(
        centroids=centroids,
        cluster_ids=tuple(ids),
        segment_of_cluster=names,
        shares=tuple(float(s) for s in shares),
        fitted_on=len(points),
        labels=kept,
    )
    logger.info(
        "segmenter fitted on %d unlabelled requests: %s",
        len(points),
        ", ".join(
            f"{CLUSTER_PREFIX}{i} {share:.2f} -> {name}"
            for i, share, name in zip(ids, shares, segmenter.segment_of_cluster, strict=True)
        ),
    )
    return segmenter


def empty_segmenter() -> Segmenter:
    """A segmenter without clusters: what a cycle stores when all its traffic is labelled."""
    return Segmenter(np.zeros((0, 0)), (), (), ())


def _same_width(previous: Segmenter, data: np.ndarray) -> bool:
    if previous.num_clusters == 0:
        return False
    if previous.centroids.shape[1] == data.shape[1]:
        return True
    logger.warning(
        "previous segmenter has hidden size %d, this traffic %d: clusters start afresh "
        "(names are not kept)",
        previous.centroids.shape[1],
        data.shape[1],
    )
    return False


def _initial(
    data: np.ndarray,
    mass: np.ndarray,
    num_clusters: int,
    previous: Segmenter | None,
    rng: np.random.Generator,
) -> tuple[list[int], np.ndarray]:
    """Cluster ids and starting centroids: the previous ones, then k-means++ for the rest."""
    ids = list(previous.cluster_ids) if previous is not None else []
    centroids = list(previous.centroids) if previous is not None else []
    wanted = max(len(ids), min(num_clusters, len(data)))
    next_id = max(ids, default=-1) + 1
    while len(centroids) < wanted:
        if centroids:
            distance = _squared_distances(data, np.stack(centroids)).min(axis=1)
        else:
            distance = np.ones(len(data))
        odds = distance * mass
        if odds.sum() <= 0:  # every point sits on a centroid: no new cluster to open
            break
        centroids.append(data[rng.choice(len(data), p=odds / odds.sum())])
        ids.append(next_id)
        next_id += 1
    return ids, np.stack(centroids)


def _squared_distances(data: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """``[N, C]`` squared distances, without an ``[N, C, H]`` intermediate."""
    distances: np.ndarray = (
        (data**2).sum(axis=1)[:, None] - 2 * data @ centroids.T + (centroids**2).sum(axis=1)[None]
    )
    clipped: np.ndarray = np.maximum(distances, 0.0)
    return clipped


def _lloyd(
    data: np.ndarray, mass: np.ndarray, centroids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted Lloyd iterations; a centroid with no points keeps its place."""
    centroids = centroids.copy()
    labels = np.zeros(len(data), dtype=np.int64)
    for iteration in range(_MAX_ITERATIONS):
        labels_now = _squared_distances(data, centroids).argmin(axis=1)
        if iteration and np.array_equal(labels_now, labels):
            break
        labels = labels_now
        for cluster in range(len(centroids)):
            members = labels == cluster
            if members.any():
                mean = np.average(data[members], axis=0, weights=mass[members])
                norm = float(np.linalg.norm(mean))
                centroids[cluster] = mean / norm if norm > 0 else mean
    return centroids, labels


def _radii(
    data: np.ndarray, mass: np.ndarray, centroids: np.ndarray, labels: np.ndarray
) -> np.ndarray:
    """Token-weighted RMS distance of each cluster's requests to its centroid (0 if empty)."""
    radii = np.zeros(len(centroids))
    for cluster in range(len(centroids)):
        members = labels == cluster
        if members.any():
            squared = ((data[members] - centroids[cluster]) ** 2).sum(axis=1)
            radii[cluster] = float(np.sqrt(np.average(squared, weights=mass[members])))
    return radii


def _kept_names(
    names: tuple[str, ...], previous: Segmenter, shares: np.ndarray, ids: list[int]
) -> tuple[str, ...]:
    """Segment names that survive a refit. Clusters keep their ids (each refit starts
    from the previous centroids), but which clusters form a segment changes with their
    shares: a merge named a segment after its lowest id, renaming the traffic of the
    others. So each new segment takes the name of the previous segment whose clusters
    hold most of its traffic (by this fit's token shares), the largest overlaps first;
    one that matches none keeps its own name, or a fresh one where that one is taken or
    was a previous segment's."""
    was = dict(zip(previous.cluster_ids, previous.segment_of_cluster, strict=True))
    overlap: dict[tuple[str, str], float] = {}
    for cluster, name in enumerate(names):
        old = was.get(ids[cluster])
        if old is not None:
            overlap[name, old] = overlap.get((name, old), 0.0) + float(shares[cluster])
    renamed: dict[str, str] = {}
    for (new, old), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
        if new not in renamed and old not in renamed.values():
            renamed[new] = old
    # a name matched, or one a gone segment held (its figures are not this traffic's)
    taken = set(renamed.values()) | set(previous.segment_of_cluster)
    fresh = (
        name
        for name in (f"{CLUSTER_PREFIX}{i}" for i in range(len(ids) + len(taken) + 1 << 10))
        if name not in taken and name not in names
    )
    for new in dict.fromkeys(names):
        if new not in renamed:
            renamed[new] = new if new not in taken else next(fresh)
            taken.add(renamed[new])
    return tuple(renamed[name] for name in names)


def _merge_small(
    centroids: np.ndarray,
    ids: list[int],
    shares: np.ndarray,
    min_share: float,
    radii: np.ndarray | None = None,
) -> tuple[str, ...]:
    """Each cluster's segment name.

    Clusters whose centroids are closer than the larger of their radii are one traffic
    split in pieces (k-means always makes as many clusters as asked): they form one
    segment. A segment under ``min_share`` counts for the nearest one at or above it.
    A segment is named after its lowest cluster id, the most stable of its names.
    """
    count = len(ids)
    group = list(range(count))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    if radii is not None:
        distance = np.sqrt(_squared_distances(centroids, centroids))
        for i in range(count):
            for j in range(i + 1, count):
                if shares[i] > 0 and shares[j] > 0 and distance[i, j] < max(radii[i], radii[j]):
                    group[root(j)] = root(i)
    members: dict[int, list[int]] = {}
    for cluster in range(count):
        members.setdefault(root(cluster), []).append(cluster)
    share_of = {r: float(shares[m].sum()) for r, m in members.items()}
    large = [r for r, share in share_of.items() if share >= min_share]
    if not large:
        large = [max(share_of, key=lambda r: share_of[r])]
    name_of = {r: f"{CLUSTER_PREFIX}{min(ids[c] for c in m)}" for r, m in members.items()}
    names = []
    for cluster in range(count):
        own = root(cluster)
        if own not in large:
            nearest = min(
                large,
                key=lambda r: min(
                    float(((centroids[c] - centroids[cluster]) ** 2).sum()) for c in members[r]
                ),
            )
            own = nearest
        names.append(name_of[own])
    return tuple(names)

"""Acceptance length per draft version and traffic segment, as a PNG (logged to MLflow)."""

from __future__ import annotations

__all__ = ["plot_acceptance", "plot_timeline"]

from pathlib import Path


def plot_acceptance(
    history: dict[str, dict[str, float]], out: Path, *, k: int, title: str = ""
) -> Path:
    """``history`` maps draft version -> segment -> acceptance length (versions in order)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    versions = list(history)
    segments = sorted({segment for figures in history.values() for segment in figures})
    figure, axes = plt.subplots(figsize=(7, 4), dpi=120)
    for segment in segments:
        values = [history[version].get(segment, float("nan")) for version in versions]
        axes.plot(versions, values, marker="o", label=segment)
    axes.set_xlabel("draft version")
    axes.set_ylabel(f"acceptance length (k={k})")
    axes.set_title(title or "Acceptance length per draft version")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.grid(alpha=0.3)
    axes.legend(title="traffic segment")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out


def plot_timeline(
    rows: list[dict[str, float | str]],
    promotions: list[tuple[float, str]],
    out: Path,
    *,
    k: int,
    title: str = "",
) -> Path:
    """Acceptance length on live traffic over time: the serving draft vs the static draft.

    ``rows`` carry ``minutes``, ``serving`` and ``static``; ``promotions`` are
    ``(minutes, version)`` marks drawn as vertical lines.
    """
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    minutes = [float(row["minutes"]) for row in rows]
    figure, axes = plt.subplots(figsize=(8, 4), dpi=120)
    axes.plot(minutes, [row["serving"] for row in rows], marker="o", label="serving draft (live)")
    axes.plot(
        minutes, [row["static"] for row in rows], marker="s", label="static draft (same traffic)"
    )
    for at, version in promotions:
        axes.axvline(at, color="green", linewidth=0.8, linestyle="--")
        axes.annotate(
            version, (at, 1.0), rotation=90, fontsize=7, va="bottom", ha="right", color="green"
        )
    axes.set_xlabel("minutes since the traffic started")
    axes.set_ylabel(f"acceptance length (k={k})")
    axes.set_title(title or "Acceptance length on live traffic")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out

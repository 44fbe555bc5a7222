"""Names every host and tool agrees on: target slugs, registered model names, aliases.

Here, apart from the lake and registry packages, because DAG files need them while
the dag-processor parses (for their Assets), and that must import nothing heavy
(no pyarrow, minio, torch or mlflow). ``tide_lib.lake`` and ``tide_lib.registry``
re-export them.
"""

from __future__ import annotations

import re

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "PREVIOUS_CHAMPION",
    "registered_model_name",
    "target_slug",
]

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"

_SLUG_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def target_slug(target_id: str) -> str:
    """A path- and registry-safe name.

    ``meta-llama/Llama-3.1-8B`` becomes ``meta-llama--llama-3.1-8b``.
    """
    slug = _SLUG_UNSAFE.sub("-", target_id.strip().lower().replace("/", "--")).strip("-.")
    if not slug:
        raise ValueError(f"target id {target_id!r} has no characters usable in a slug")
    return slug


def registered_model_name(target_id: str) -> str:
    """``tide-draft-<slug>``: the MLflow registered model of a target's drafts."""
    return f"tide-draft-{target_slug(target_id)}"

"""The loop's Airflow Assets: the lake window, the registered drafts, the champion.

Airflow's asset graph shows what ``tide_adaptation`` consumes and produces, and a
user's own DAG can be scheduled on them, for example re-running a benchmark
whenever a new champion reaches the fleet::

    from tide_lib.orchestration.assets import champion_asset

    @dag(schedule=[champion_asset()])
    def after_promotion(): ...

Assets are named per target: the deployment's ``cycle.target_id`` when the file
is parsed (one deployment serves one target; a run whose form names another
target still emits on these, with its ``target_id`` in the event). Each event carries what
identifies it in ``extra``: the window's tokens and commits, the version number,
the champion's acceptance length. The deferrable sensor still decides when a
cycle starts: an asset watcher cannot count tokens.
"""

from __future__ import annotations

__all__ = ["champion_asset", "draft_asset", "emit", "lake_asset"]

from typing import TYPE_CHECKING, Any

from tide_lib.config import load_config
from tide_lib.names import CHAMPION, registered_model_name, target_slug

if TYPE_CHECKING:
    from airflow.sdk import Asset

_GROUP = "tide"


def _target() -> str:
    return load_config().cycle.target_id


def lake_asset(target_id: str | None = None) -> Asset:
    """The target's hidden-state lake; an event per cycle window frozen from it."""
    from airflow.sdk import Asset  # noqa: PLC0415

    config = load_config()
    slug = target_slug(target_id or config.cycle.target_id)
    uri = f"s3://{config.store.lake_bucket}/{config.lake.prefix}/target={slug}"
    return Asset(name=f"tide_lake_{slug}", uri=uri, group=_GROUP)


def draft_asset(target_id: str | None = None) -> Asset:
    """The target's registered drafts (``tide-draft-<slug>``); an event per new version."""
    from airflow.sdk import Asset  # noqa: PLC0415

    name = registered_model_name(target_id or _target())
    return Asset(name=name.replace("-", "_"), uri=f"models:/{name}", group=_GROUP)


def champion_asset(target_id: str | None = None) -> Asset:
    """The version the fleet serves (alias ``champion``); an event per promotion or rollback."""
    from airflow.sdk import Asset  # noqa: PLC0415

    name = registered_model_name(target_id or _target())
    return Asset(
        name=f"{name.replace('-', '_')}_champion", uri=f"models:/{name}@{CHAMPION}", group=_GROUP
    )


def emit(context: Any, target_id: str, extra: dict[str, Any]) -> None:
    """Attach ``extra`` (JSON values) and the run's target to the event of each asset
    this task declares as an outlet: the declared objects themselves, so a worker whose
    environment differs from the dag-processor's still fills in the right events."""
    for asset in context["task"].outlets:
        context["outlet_events"][asset].extra = {"target_id": target_id, **extra}

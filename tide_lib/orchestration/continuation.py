"""Training that kept its champion hands what it learned to the next cycle.

A warm start exports a trained draft only on a gain beyond the noise of the
window's held-out requests; a window of a new segment holds a dozen, so a cycle
can train for real and still keep its parent, and the next cycle used to start
from the champion again: a new segment that an oracle learns in 300 steps was
never learned in cycles of 200. So a run that kept its parent leaves its best
trained step (above the parent, forgetting nothing: see
:meth:`~tide_lib.training.selection.Selection.continuation`) in the lake, keyed
by the champion it started from, and the next cycle training on that same
champion starts there. The champion stays that run's step 0, its distillation
teacher and the draft to beat; a continuation of a champion that was replaced is
read again only if a rollback makes that champion serve again (the gate judges what
comes of it). A run that started from a continuation consumes it: it leaves its
own, or none. The trainer hosts share it through the object store, never a
disk. Off with ``cycle.continue_training: false``.
"""

from __future__ import annotations

__all__ = ["drop_continuation", "fetch_continuation", "keep_continuation"]

import logging
from pathlib import Path

from tide_lib.config import TideConfig
from tide_lib.orchestration.state import lake_store, state_key

logger = logging.getLogger(__name__)


def _weights() -> str:
    """The draft file uploaded last and removed first: with it, a continuation is
    complete (the training package imports torch, which a DAG file's imports must not)."""
    from tide_lib.training.draft import WEIGHTS_FILE  # noqa: PLC0415

    return WEIGHTS_FILE


def _prefix(config: TideConfig, champion_version: str) -> str:
    return state_key(config, f"continuations/v{champion_version}/")


def fetch_continuation(
    config: TideConfig, champion_version: str | None, directory: Path
) -> Path | None:
    """Download the continuation left for ``champion_version`` into ``directory``; None
    when there is none (or continuing is off)."""
    if champion_version is None or not config.cycle.continue_training:
        return None
    store, prefix = lake_store(config), _prefix(config, champion_version)
    if not store.exists(prefix + _weights()):
        return None
    directory.mkdir(parents=True, exist_ok=True)
    for info in store.list(prefix):
        store.get_file(info.key, directory / info.key.removeprefix(prefix))
    from tide_lib.training.draft import InvalidCheckpointError, validate_draft_dir  # noqa: PLC0415

    try:
        validate_draft_dir(directory)
    except InvalidCheckpointError as error:  # a bad object must not fail every later cycle
        logger.warning("dropping the continuation of champion v%s: %s", champion_version, error)
        drop_continuation(config, champion_version)
        return None
    logger.info("continuing the training an earlier cycle did on champion v%s", champion_version)
    return directory


def keep_continuation(config: TideConfig, champion_version: str, draft_dir: Path) -> None:
    """Leave ``draft_dir`` (a run's continuation) for the next cycle on this champion."""
    if not config.cycle.continue_training:
        return
    store, prefix = lake_store(config), _prefix(config, champion_version)
    files = sorted(draft_dir.iterdir(), key=lambda path: path.name == _weights())
    for path in files:
        store.put_file(prefix + path.name, path)
    logger.info("kept the run's best step for the next cycle on champion v%s", champion_version)


def drop_continuation(config: TideConfig, champion_version: str) -> None:
    """Forget the continuation of ``champion_version`` (consumed, or nothing new to keep)."""
    store, prefix = lake_store(config), _prefix(config, champion_version)
    keys = sorted((info.key for info in store.list(prefix)), key=lambda k: k != prefix + _weights())
    for key in keys:  # the weights first: a half-removed continuation is never read
        store.remove(key)

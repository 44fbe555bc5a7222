"""TIDE's error boundary: every error TIDE raises for its user derives from :class:`TideError`.

Its message names what went wrong and what to do about it, so the CLI prints it as
one line, without a traceback (``cli.main`` catches :class:`TideError` once), and a
DAG task's log shows the same sentence. Each class keeps the builtin base that says
what kind of failure it is (``ValueError`` for bad input, ``ConnectionError`` for a
server that does not answer), so callers that catch those still do.
"""

from __future__ import annotations

__all__ = ["TideError"]


class TideError(Exception):
    """An error whose message tells the user what is wrong and how to fix it."""

"""TIDE: keeps EAGLE3 draft models fitted to the traffic a serving fleet actually sees.

One package per stage of the loop: ``lake`` (captured hidden states in S3),
``stack`` (the local services), and, as they land, ``training``, ``evaluation``,
``registry``, ``serving`` and ``orchestration``; ``config`` and ``cli`` serve all.
"""

__version__ = "0.1.0"

"""A request's segment label, from SGLang's tokenizer process to its scheduler.

The client's ``custom_labels["segment"]`` stays behind in the tokenizer process
(``TokenizedGenerateReqInput`` has no labels). SGLang 0.5.14's requests are
dataclasses, so the label rides as an attribute pickled along. Later releases made
them ``msgspec`` Structs without ``__dict__``: there the tokenized request is
re-made as :class:`TideTokenizedGenerateReqInput`, a subclass with one declared
field, which SGLang's dispatcher routes as its base (it matches by type, base
classes included). That subclass crosses to the scheduler by pickle, SGLang's
default IPC; under msgpack IPC (``SGLANG_USE_PICKLE_IPC=0``) the scheduler would
reject an unknown tag, so the request goes unlabelled instead (its record is
segmented by clustering).
"""

from __future__ import annotations

__all__ = ["SEGMENT_ATTRIBUTE", "labelled_type", "with_segment"]

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

SEGMENT_ATTRIBUTE = "tide_segment"
_LABELLED = "TideTokenizedGenerateReqInput"
_made: dict[type, type] = {}


def _base() -> type:
    """SGLang's ``TokenizedGenerateReqInput`` (a seam for tests without SGLang)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: PLC0415

    kind: type = TokenizedGenerateReqInput
    return kind


def _pickled_ipc() -> bool:
    """Does this SGLang send requests between its processes by pickle?"""
    from sglang.srt.managers import io_struct  # noqa: PLC0415

    return bool(getattr(io_struct, "_USE_PICKLE_IPC", True))


def labelled_type(base: type) -> type:
    """``base`` (a Struct request type) with a declared ``tide_segment`` field, made once
    and findable by pickle as this module's ``TideTokenizedGenerateReqInput``."""
    if base not in _made:
        namespace = {
            "__module__": __name__,
            "__qualname__": _LABELLED,
            "__annotations__": {SEGMENT_ATTRIBUTE: "str | None"},
            SEGMENT_ATTRIBUTE: None,
        }
        _made[base] = type(base)(_LABELLED, (base,), namespace, kw_only=True)
    return _made[base]


def __getattr__(name: str) -> Any:
    """Pickle finds the labelled type by name in the scheduler process."""
    if name == _LABELLED:
        return labelled_type(_base())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def with_segment(request: Any, segment: str) -> Any:
    """``request`` carrying ``segment`` to the scheduler (itself, or a labelled copy)."""
    if dataclasses.is_dataclass(request):
        setattr(request, SEGMENT_ATTRIBUTE, segment)
        return request
    if not _pickled_ipc() or type(request) is not _base():
        # msgpack IPC refuses unknown tags; a type SGLang derived itself would not pickle
        # by our name: the request is served, its record goes unlabelled
        logger.debug("request %s goes unlabelled", getattr(request, "rid", "?"))
        return request
    names: tuple[str, ...] = getattr(type(request), "__struct_fields__", ())
    fields = {name: getattr(request, name) for name in names}
    return labelled_type(type(request))(**fields, **{SEGMENT_ATTRIBUTE: segment})

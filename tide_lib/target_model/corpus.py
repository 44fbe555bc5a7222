"""Text that ships inside installed packages, split into domains.

No dataset can be downloaded here, so the demo world is built from what pip
installs: English and Korean conversations (``chatterbot-corpus``), English
documentation (the standard library's ``pydoc_data.topics``) and Korean legal
text (the ``konlpy`` wheel's ``data/corpus``, read as files, never imported).
Every domain is split deterministically into train and held-out parts by a hash
of the text, so that the split does not depend on file order.
"""

from __future__ import annotations

__all__ = ["DOMAINS", "Corpus", "Document", "load_corpus", "package_dir"]

import dataclasses
import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Final

import yaml

logger = logging.getLogger(__name__)

DOMAINS: Final = ("en_chat", "ko_chat", "en_docs", "ko_docs")
_HELD_OUT_PERCENT: Final = 10


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """One conversation (alternating user/assistant turns) or one passage of prose."""

    domain: str
    turns: tuple[str, ...]

    @property
    def is_chat(self) -> bool:
        return self.domain.endswith("_chat")

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256("\x1f".join(self.turns).encode()).digest()
        return digest[0] * 100 // 256 < _HELD_OUT_PERCENT


@dataclasses.dataclass(frozen=True)
class Corpus:
    documents: tuple[Document, ...]

    def domain(self, name: str, *, held_out: bool | None = None) -> list[Document]:
        return [
            doc
            for doc in self.documents
            if doc.domain == name and (held_out is None or doc.held_out == held_out)
        ]

    def texts(self) -> list[str]:
        return ["\n".join(doc.turns) for doc in self.documents]


def package_dir(package: str) -> Path:
    """The installed folder of ``package`` without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; `make venv` installs it "
            "(pyproject's `demo` extra, or requirements-nodeps.txt for konlpy)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _chatterbot(language: str, domain: str) -> list[Document]:
    folder = package_dir("chatterbot_corpus") / "data" / language
    documents = []
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conversation in data.get("conversations", []):
            turns = tuple(str(turn).strip() for turn in conversation if str(turn).strip())
            if len(turns) >= 2:
                documents.append(Document(domain, turns))
    return documents


def _paragraphs(text: str, min_chars: int = 40, max_chars: int = 1200) -> list[str]:
    paragraphs: list[str] = []
    for block in text.split("\n\n"):
        flat = " ".join(block.split())
        if len(flat) >= min_chars:
            paragraphs.extend(flat[i : i + max_chars] for i in range(0, len(flat), max_chars))
    return paragraphs


def _pydoc_topics() -> list[Document]:
    from pydoc_data.topics import topics  # noqa: PLC0415  (standard library data)

    return [
        Document("en_docs", (paragraph,))
        for name in sorted(topics)
        for paragraph in _paragraphs(topics[name])
    ]


def _konlpy_texts() -> list[Document]:
    folder = package_dir("konlpy") / "data" / "corpus"
    return [
        Document("ko_docs", (paragraph,))
        for path in sorted(folder.rglob("*.txt"))
        for paragraph in _paragraphs(path.read_text(encoding="utf-8", errors="ignore"))
    ]


def load_corpus() -> Corpus:
    """Every domain of the demo world, in a fixed order."""
    documents = (
        _chatterbot("english", "en_chat")
        + _chatterbot("korean", "ko_chat")
        + _pydoc_topics()
        + _konlpy_texts()
    )
    counts = {domain: sum(doc.domain == domain for doc in documents) for domain in DOMAINS}
    logger.info("corpus: %s documents per domain", counts)
    return Corpus(tuple(documents))

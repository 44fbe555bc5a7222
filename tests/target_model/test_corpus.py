"""The packaged corpus: every domain present, deterministic split."""

from __future__ import annotations

from tide_lib.target_model import DOMAINS, load_corpus


def test_every_domain_has_train_and_held_out_documents() -> None:
    corpus = load_corpus()
    for domain in DOMAINS:
        assert len(corpus.domain(domain, held_out=False)) > 20, domain
        assert len(corpus.domain(domain, held_out=True)) > 2, domain


def test_split_is_deterministic_and_disjoint() -> None:
    first, second = load_corpus(), load_corpus()
    assert first.documents == second.documents
    held = {doc.turns for doc in first.documents if doc.held_out}
    train = {doc.turns for doc in first.documents if not doc.held_out}
    assert held and train and not held & train


def test_korean_chat_is_korean() -> None:
    sample = load_corpus().domain("ko_chat")[0].turns[0]
    assert any("\uac00" <= ch <= "\ud7a3" for ch in sample)

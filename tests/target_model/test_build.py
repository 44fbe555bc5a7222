"""The demo target: HF format, deterministic, cached, reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tide_lib.target_model import build_target, encode_document, load_corpus, render_prompt

pytestmark = pytest.mark.slow


def test_target_loads_with_hf_auto_classes(tiny_target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    assert model.config.architectures == ["LlamaForCausalLM"]
    ids = tokenizer(
        render_prompt("안녕하세요"), add_special_tokens=False, return_tensors="pt"
    ).input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    info = json.loads((tiny_target / "build_info.json").read_text())
    assert set(info["held_out_loss"]) == {"en_chat", "ko_chat", "en_docs", "ko_docs"}
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_same_seed_same_weights_and_cache_reuse(tiny_target: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_target(again, preset_name="tiny", seed=0)
    first, second = (
        load_file(tiny_target / "model.safetensors"),
        load_file(again / "model.safetensors"),
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    build_target(again, preset_name="tiny", seed=0)  # cached: nothing rewritten
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_byte_level_bpe_round_trips_and_merges_korean(tiny_target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    text = " ".join(doc.turns[0] for doc in load_corpus().domain("ko_chat")[:50])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < 0.7 * len(text.encode())  # merges beyond raw UTF-8 bytes even at 1k vocab


def test_loss_mask_marks_assistant_turns(tiny_target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    document = load_corpus().domain("en_chat")[0]
    ids, mask = encode_document(tokenizer, document)
    assert len(ids) == len(mask)
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    first = ids.index(assistant)
    assert mask[: first + 1] == [0] * (first + 1) and mask[first + 1] == 1


def test_unknown_preset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown target preset 'huge'"):
        build_target(tmp_path, preset_name="huge")

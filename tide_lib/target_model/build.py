"""``tide target build``: the demo world's target model, trained by TIDE itself.

No weights can be downloaded here, so the demo target is a small Llama-architecture
``transformers`` model trained on the packaged corpus (:mod:`tide_lib.target_model.corpus`)
and saved in HF format (config, safetensors, tokenizer), so that the same loading
code takes a real target such as Llama or gpt-oss.

Tokenizer: a byte-level BPE trained with ``tokenizers`` on the same corpus,
instead of mistral-common's 32k SentencePiece vocabulary. On a CPU target the
output layer dominates, and an 8k vocabulary makes it about 4x cheaper; it also
encodes Korean in about half the tokens (a byte-level BPE that saw Korean learns
whole syllables), which keeps Korean sequences short.

Builds are deterministic for a preset and seed, and cached: a directory whose
``build_info.json`` matches the requested build is reused as is.
"""

from __future__ import annotations

__all__ = [
    "ASSISTANT",
    "PRESETS",
    "USER",
    "TargetPreset",
    "build_target",
    "encode_document",
    "model_config",
    "render_prompt",
]

import dataclasses
import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Final

import torch
from tqdm import tqdm

from tide_lib.target_model.corpus import DOMAINS, Corpus, Document, load_corpus
from tide_lib.training.schedule import warmup_cosine

logger = logging.getLogger(__name__)

BOS: Final = "<|bos|>"
EOS: Final = "<|eos|>"
PAD: Final = "<|pad|>"
USER: Final = "<|user|>"
ASSISTANT: Final = "<|assistant|>"
SPECIAL_TOKENS: Final = (PAD, BOS, EOS, USER, ASSISTANT)
CHAT_TEMPLATE: Final = (
    "{{ '<|bos|>' }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% else %}{{ '<|assistant|>' + message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
BUILD_INFO: Final = "build_info.json"
BUILD_FORMAT: Final = 1


@dataclasses.dataclass(frozen=True)
class TargetPreset:
    """Shape and training budget of a demo target."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    learning_rate: float


PRESETS: Final[dict[str, TargetPreset]] = {
    # ~9M parameters; a few minutes on 2 cores.
    "demo": TargetPreset(
        vocab_size=8192,
        hidden_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,  # grouped-query attention, as in Llama 3
        intermediate_size=688,  # SwiGLU's 8/3 x hidden_size, up to a multiple of 16
        seq_len=128,
        batch_size=16,
        steps=320,
        learning_rate=3e-3,
    ),
    # Seconds, for tests.
    "tiny": TargetPreset(
        vocab_size=1024,
        hidden_size=64,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        seq_len=64,
        batch_size=8,
        steps=60,
        learning_rate=5e-3,
    ),
}


def render_prompt(user_text: str) -> str:
    """The text an engine is given for a single-turn chat request."""
    return f"{BOS}{USER}{user_text}{ASSISTANT}"


def encode_document(tokenizer: Any, document: Document) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant turns, or everywhere for prose)."""
    bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOS])
    ids, mask = [bos], [0]
    if not document.is_chat:
        body = tokenizer.encode(document.turns[0], add_special_tokens=False)
        return [*ids, *body, eos], [*mask, *([1] * (len(body) + 1))]
    for index, turn in enumerate(document.turns):
        role = USER if index % 2 == 0 else ASSISTANT
        marker = tokenizer.convert_tokens_to_ids(role)
        body = tokenizer.encode(turn, add_special_tokens=False)
        ids += [marker, *body]
        mask += [0] * (1 + len(body)) if role == USER else [0, *([1] * len(body))]
    return [*ids, eos], [*mask, 1]


def _train_tokenizer(corpus: Corpus, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(preset: TargetPreset, tokenizer: Any) -> Any:
    """The Llama configuration of ``preset``'s shape over ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def _token_stream(tokenizer: Any, documents: list[Document]) -> torch.Tensor:
    ids: list[int] = []
    for document in documents:
        ids += encode_document(tokenizer, document)[0]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def _held_out_loss(model: Any, tokenizer: Any, documents: list[Document], seq_len: int) -> float:
    stream = _token_stream(tokenizer, documents)
    if stream.numel() < 2:
        return float("nan")
    total, count = 0.0, 0
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len + 1]
        if window.numel() < 2:
            break
        logits = model(input_ids=window[None, :-1]).logits[0]
        total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
        count += window.numel() - 1
    return total / count


def _build_key(preset_name: str, preset: TargetPreset, seed: int) -> dict[str, Any]:
    return {
        "format": BUILD_FORMAT,
        "preset": preset_name,
        "seed": seed,
        **dataclasses.asdict(preset),
    }


def build_target(
    out_dir: Path, *, preset_name: str = "demo", seed: int = 0, force: bool = False
) -> dict[str, Any]:
    """Build (or reuse) the demo target in ``out_dir``; returns its build report."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    if preset_name not in PRESETS:
        raise ValueError(f"unknown target preset {preset_name!r}; choose from {sorted(PRESETS)}")
    preset = PRESETS[preset_name]
    key = _build_key(preset_name, preset, seed)
    info_path = out_dir / BUILD_INFO
    if not force and info_path.is_file():
        info: dict[str, Any] = json.loads(info_path.read_text())
        if info.get("key") == key:
            logger.info("reusing the target built in %s (%s)", out_dir, preset_name)
            return info

    started = time.perf_counter()
    random.seed(seed)
    torch.manual_seed(seed)
    corpus = load_corpus()
    tokenizer = _train_tokenizer(corpus, preset.vocab_size)
    train_docs = [doc for doc in corpus.documents if not doc.held_out]
    random.Random(seed).shuffle(train_docs)
    stream = _token_stream(tokenizer, train_docs)
    logger.info(
        "training a %d-layer, %d-wide target on %d tokens (%s preset)",
        preset.num_layers,
        preset.hidden_size,
        stream.numel(),
        preset_name,
    )

    model = LlamaForCausalLM(model_config(preset, tokenizer))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.learning_rate, weight_decay=0.01)
    warmup = max(1, preset.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup, preset.steps)
    )
    generator = torch.Generator().manual_seed(seed)
    progress = tqdm(range(preset.steps), desc=f"target {preset_name}", unit="step")
    loss_value = float("nan")
    for _step in progress:
        starts = torch.randint(
            0, stream.numel() - preset.seq_len - 1, (preset.batch_size,), generator=generator
        )
        batch = torch.stack([stream[s : s + preset.seq_len + 1] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = float(loss.detach())
        progress.set_postfix(loss=f"{loss_value:.3f}")
    model.eval()

    loss_per_domain = {
        domain: _held_out_loss(
            model, tokenizer, corpus.domain(domain, held_out=True), preset.seq_len
        )
        for domain in DOMAINS
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "key": key,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": int(stream.numel()),
        "tokens_seen": preset.steps * preset.batch_size * preset.seq_len,
        "final_train_loss": loss_value,
        "held_out_loss": loss_per_domain,
        "build_seconds": time.perf_counter() - started,
        "torch_threads": torch.get_num_threads(),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    logger.info("built target in %s: %s", out_dir, json.dumps(info))
    return info

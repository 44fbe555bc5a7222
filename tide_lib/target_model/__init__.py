"""The target model side: the demo target TIDE builds, and hidden-state capture from HF models."""

__all__ = [
    "DOMAINS",
    "PRESETS",
    "Corpus",
    "Document",
    "HiddenStateCapture",
    "build_target",
    "eagle_aux_layer_ids",
    "encode_document",
    "load_corpus",
    "model_config",
    "render_prompt",
]

from tide_lib.target_model.build import (
    PRESETS,
    build_target,
    encode_document,
    model_config,
    render_prompt,
)
from tide_lib.target_model.corpus import DOMAINS, Corpus, Document, load_corpus
from tide_lib.target_model.hidden import HiddenStateCapture, eagle_aux_layer_ids

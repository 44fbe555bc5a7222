"""The adaptive k and segment labels use SGLang's names, read from each supported wheel."""

from __future__ import annotations

from tests.contract.sglang_release import Release
from tide_lib.config import ServeConfig
from tide_lib.serving.server import CUSTOM_LABELS_HEADER, GenerateRequest


def test_speculative_adaptive_is_sglang_server_argument(sglang: Release) -> None:
    fields = sglang.server_args_fields()
    assert {"speculative_adaptive", "speculative_num_steps"} <= fields
    assert "speculative_adaptive" in ServeConfig.model_fields


def test_the_active_k_metric_is_sglang_spec_num_steps(sglang: Release) -> None:
    names = sglang.string_constants("sglang.srt.observability.metrics_collector")
    assert "sglang:spec_num_steps" in names


def test_segment_labels_travel_in_sglang_custom_labels(sglang: Release) -> None:
    generate = sglang.dataclass_fields("sglang.srt.managers.io_struct", "GenerateReqInput")
    assert "custom_labels" in generate and "custom_labels" in GenerateRequest.model_fields
    completions = sglang.dataclass_fields(
        "sglang.srt.entrypoints.openai.protocol", "CompletionRequest"
    )
    assert "custom_labels" in completions
    server_args = sglang.server_args_text()
    assert f'= "{CUSTOM_LABELS_HEADER}"' in server_args  # the label header's default name

"""The capture contract: what the writer accepts and the message when it refuses."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import make_record
from tide_lib.lake.schema import (
    CapturedRecord,
    InvalidRecordError,
    records_to_table,
    validate_record,
)


def test_valid_numpy_and_torch_records_pass() -> None:
    record = make_record()
    validate_record(record)
    as_torch = dataclasses.replace(
        record,
        input_ids=torch.from_numpy(record.input_ids),
        loss_mask=torch.from_numpy(record.loss_mask).bool(),
        hidden_states=torch.from_numpy(record.hidden_states.astype(np.float32)).bfloat16(),
        aux_hidden_states=torch.from_numpy(record.aux_hidden_states.astype(np.float32)).bfloat16(),
    )
    validate_record(as_torch)
    table = records_to_table([record, as_torch])
    assert table.column("hidden_dtype").to_pylist() == ["float16", "bfloat16"]
    assert table.column("num_tokens").to_pylist() == [12, 12]


def _bad(**changes: object) -> object:
    return dataclasses.replace(make_record(), **changes)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (_bad(request_id=""), "request_id must be a non-empty string"),
        (_bad(target_id=None), "target_id must be a non-empty string"),
        (_bad(finished_at=datetime(2026, 1, 1)), "finished_at must be a timezone-aware"),
        (
            _bad(started_at=make_record().finished_at + timedelta(seconds=5)),
            "is before started_at",
        ),
        (_bad(input_ids=[1, 2, 3]), "input_ids must be a numpy array or torch tensor"),
        (_bad(input_ids=np.zeros(0, dtype=np.int64)), "input_ids must be 1-D and non-empty"),
        (
            _bad(loss_mask=np.ones(11, dtype=np.int8)),
            r"loss_mask has shape \(11,\), expected \(12,\)",
        ),
        (_bad(hidden_states=np.zeros((11, 16), np.float16)), r"hidden_states has shape \(11, 16\)"),
        (
            _bad(aux_hidden_states=np.zeros((12, 32), np.float16)),
            r"aux_hidden_states has shape \(12, 32\), expected \(12, 48\)",
        ),
        (_bad(hidden_states=np.zeros((12, 16), np.float32)), "hidden_states dtype is float32"),
        (
            _bad(aux_hidden_states=torch.zeros((12, 48), dtype=torch.bfloat16)),
            "aux_hidden_states dtype bfloat16 differs from hidden_states float16",
        ),
        (_bad(input_ids=np.zeros(12, np.float32)), "input_ids must hold integers"),
        (_bad(spec_verify_ct=-1), "spec_verify_ct must be a non-negative int"),
        ("not a record", "expected a CapturedRecord"),
    ],
)
def test_bad_records_are_refused_with_the_field_named(record: object, message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        validate_record(record)  # type: ignore[arg-type]


def test_a_record_of_any_origin_saves_as_specforges_offline_file(tmp_path: Path) -> None:
    """One writer of the ``.ckpt`` format: a record serving built (int32 ids, int8 mask,
    torch float16 states) and one with numpy arrays both save as SpecForge loads them."""
    numpy_record = make_record(tokens=7, hidden=8)
    served = CapturedRecord.of_forward(
        "req-served",
        datetime.now(UTC),
        ([5, 6, 7, 8], [0, 0, 1, 1]),
        (torch.randn(4, 8), torch.randn(4, 24)),
        target_id="t",
        draft_version="v1",
    )
    for index, record in enumerate((numpy_record, served)):
        path = record.save_specforge(tmp_path / "data", index, segment="s")
        assert path.name == f"data_{index:08d}.ckpt"
        saved = torch.load(path, weights_only=True)
        tokens = len(record.input_ids)
        assert saved["input_ids"].dtype == saved["loss_mask"].dtype == torch.int64
        assert saved["input_ids"].tolist() == [int(t) for t in record.input_ids]
        assert saved["loss_mask"].tolist() == [int(m) for m in record.loss_mask]
        assert saved["hidden_state"].dtype == saved["aux_hidden_state"].dtype == torch.float16
        assert saved["hidden_state"].shape == (tokens, 8)
        assert saved["aux_hidden_state"].shape == (tokens, 24)
        assert saved["segment"] == "s"

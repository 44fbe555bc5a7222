"""The capture contract: what the writer accepts and the message when it refuses."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import numpy as np
import pytest
import torch

from tests.conftest import make_record
from tide_lib.lake.schema import InvalidRecordError, records_to_table, validate_record


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

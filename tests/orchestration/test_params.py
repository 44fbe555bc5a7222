"""The trigger form is CycleConfig's own schema, and defaults resolve when a run starts."""

from __future__ import annotations

import pytest
from airflow.exceptions import ParamValidationError
from airflow.sdk.definitions.param import ParamsDict

from tide_lib.config import CycleConfig
from tide_lib.orchestration.params import config_from_params, cycle_params, param_schema


def test_the_form_keeps_the_fields_limits_titles_and_enums() -> None:
    schema = param_schema(CycleConfig, "held_out_percent", "TIDE_CYCLE__")
    assert schema["minimum"] == 1 and schema["maximum"] == 50
    assert schema["title"] == "Held Out Percent"
    assert schema["type"] == ["integer", "null"]
    assert "TIDE_CYCLE__HELD_OUT_PERCENT" in schema["description"]
    lookback = param_schema(CycleConfig, "replay_lookback_hours", "TIDE_CYCLE__")
    assert lookback["exclusiveMinimum"] == 0
    assert "format" not in param_schema(CycleConfig, "target_path", "TIDE_CYCLE__")


def test_the_form_refuses_a_value_outside_a_fields_limits() -> None:
    params = ParamsDict(cycle_params())
    params.validate()  # all empty: every field the deployment's setting
    for name, value in [("held_out_percent", 80), ("min_new_tokens", 0), ("replay_share", -1)]:
        with pytest.raises(ParamValidationError, match="On instance"):
            ParamsDict(cycle_params())[name] = value
    wrong_type = ParamsDict(cycle_params())
    with pytest.raises(ParamValidationError):
        wrong_type["min_new_tokens"] = "many"


def test_defaults_resolve_when_the_run_starts_not_when_the_file_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIDE_CYCLE__MIN_NEW_TOKENS", "1234")
    params = cycle_params()  # parsed with one environment...
    assert all(param.value is None for param in params.values())
    monkeypatch.setenv("TIDE_CYCLE__MIN_NEW_TOKENS", "777")  # ...run in another
    resolved = ParamsDict(params).validate()
    assert config_from_params(resolved).cycle.min_new_tokens == 777
    resolved["min_new_tokens"] = 5000  # what the form filled in wins
    resolved["gate_tolerance"] = 0.3
    config = config_from_params(resolved)
    assert config.cycle.min_new_tokens == 5000 and config.gate.tolerance == 0.3

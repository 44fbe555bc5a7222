"""Airflow ``Param``s that mirror :class:`~tide_lib.config.CycleConfig`, and back again.

The form a user fills in the Airflow UI is generated from the typed configuration,
so the two cannot drift; what comes back is validated by the same model.
"""

from __future__ import annotations

from datetime import timedelta
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from tide_lib.config import CycleConfig, GateConfig, TideConfig, load_config

__all__ = ["adaptation_schedule", "config_from_params", "cycle_params"]

_JSON_TYPES: dict[object, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}
_GATE_FIELDS = ("margin", "tolerance")
_PARSE_TIME_FIELDS = frozenset({"schedule_minutes"})  # DAG settings, not per-run ones


def _schema(annotation: Any) -> dict[str, Any]:
    if get_origin(annotation) in (Union, UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    if get_origin(annotation) is Literal:
        return {"type": "string", "enum": list(get_args(annotation))}
    if get_origin(annotation) is list:
        return {"type": "array"}
    return {"type": _JSON_TYPES.get(annotation, "string")}


def cycle_params() -> dict[str, Any]:
    """``Param`` objects for the adaptation DAG's trigger form (cycle and gate fields)."""
    from airflow.sdk import Param  # noqa: PLC0415

    defaults = load_config()
    params: dict[str, Any] = {}
    for name, field in CycleConfig.model_fields.items():
        if name in _PARSE_TIME_FIELDS:
            continue
        value = getattr(defaults.cycle, name)
        params[name] = Param(
            str(value) if not isinstance(value, int | float | bool | list) else value,
            description=field.description or name,
            **_schema(field.annotation),
        )
    for name in _GATE_FIELDS:
        field = GateConfig.model_fields[name]
        params[f"gate_{name}"] = Param(
            getattr(defaults.gate, name), description=field.description or name, type="number"
        )
    return params


def adaptation_schedule() -> timedelta | None:
    """The adaptation DAG's schedule from ``cycle.schedule_minutes`` (0: triggered only)."""
    minutes = load_config().cycle.schedule_minutes
    return timedelta(minutes=minutes) if minutes else None


def config_from_params(params: dict[str, Any]) -> TideConfig:
    """The run's configuration: environment defaults overridden by the form, validated."""
    base = load_config()
    cycle = {
        name: params[name]
        for name in CycleConfig.model_fields
        if name in params and name not in _PARSE_TIME_FIELDS
    }
    gate = {name: params[f"gate_{name}"] for name in _GATE_FIELDS if f"gate_{name}" in params}
    return base.model_copy(
        update={
            "cycle": CycleConfig.model_validate({**base.cycle.model_dump(), **cycle}),
            "gate": GateConfig.model_validate({**base.gate.model_dump(), **gate}),
        }
    )

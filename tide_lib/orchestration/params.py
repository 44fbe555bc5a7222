"""Airflow ``Param``s generated from :class:`~tide_lib.config.CycleConfig`'s JSON schema.

The trigger form a user fills in the Airflow UI is the typed configuration's own
schema (titles, descriptions, ``ge``/``le`` limits, enums), so the form refuses what
the model would refuse, before a run exists. Every field defaults to empty, which
means "the deployment's setting when the run starts": defaults are resolved by
:func:`config_from_params` inside the run, never frozen from the environment of
the dag-processor that parsed the file.
"""

from __future__ import annotations

__all__ = ["adaptation_schedule", "config_from_params", "cycle_params", "param_schema"]

from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from tide_lib.config import CycleConfig, GateConfig, TideConfig, load_config

_GATE_FIELDS = ("margin", "tolerance")
_PARSE_TIME_FIELDS = frozenset({"schedule_minutes"})  # DAG settings, not per-run ones
# JSON-schema keywords the form keeps; "format: path" and pydantic's extras are dropped.
_KEPT = (
    "type",
    "title",
    "description",
    "enum",
    "items",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
)


def param_schema(model: type[BaseModel], name: str, env_prefix: str) -> dict[str, Any]:
    """The Param schema of ``model.name``: its JSON schema, nullable (empty = deployment
    setting), with the environment variable and the model's default in the description."""
    prop = dict(model.model_json_schema()["properties"][name])
    variants = prop.pop("anyOf", None)
    if variants:  # Optional[X]: X's schema; null is added below for every field anyway
        prop.update(next(v for v in variants if v.get("type") != "null"))
    schema = {key: prop[key] for key in _KEPT if key in prop}
    if "enum" in schema:  # empty (None) stays a choice
        schema["enum"] = [*schema["enum"], None]
    kind = schema.get("type", "string")
    schema["type"] = [kind, "null"] if isinstance(kind, str) else [*kind, "null"]
    default = model.model_fields[name].get_default(call_default_factory=True)
    schema["description"] = (
        f"{schema.get('description', name)}. Empty: the deployment's setting "
        f"({env_prefix}{name.upper()}) when the run starts; built-in default {default!r}."
    )
    return schema


def cycle_params() -> dict[str, Any]:
    """``Param`` objects for the adaptation DAG's trigger form (cycle and gate fields)."""
    from airflow.sdk import Param  # noqa: PLC0415

    def param(model: type[BaseModel], name: str, env_prefix: str) -> Any:
        # Airflow keeps the description beside the schema (in it, deserialising fails)
        schema = param_schema(model, name, env_prefix)
        return Param(None, description=schema.pop("description"), **schema)

    params = {
        name: param(CycleConfig, name, "TIDE_CYCLE__")
        for name in CycleConfig.model_fields
        if name not in _PARSE_TIME_FIELDS
    }
    for name in _GATE_FIELDS:
        params[f"gate_{name}"] = param(GateConfig, name, "TIDE_GATE__")
    return params


def adaptation_schedule() -> timedelta | None:
    """The adaptation DAG's schedule from ``cycle.schedule_minutes`` (0: triggered only)."""
    minutes = load_config().cycle.schedule_minutes
    return timedelta(minutes=minutes) if minutes else None


def config_from_params(params: dict[str, Any], *, export: bool = True) -> TideConfig:
    """The run's configuration: the environment's settings, read now (with the Airflow
    connections of :mod:`~tide_lib.orchestration.connections` over them), overridden by
    what the form filled in (empty fields keep the setting), validated by the same models.

    ``export`` puts the connections' values into this process's environment too (a task
    process, for what it starts); a trigger, which shares its process, passes False.
    """
    from tide_lib.orchestration.connections import connection_settings  # noqa: PLC0415

    base = load_config()
    connections = connection_settings(base)
    if connections.used:
        if export:
            connections.export()
        base = load_config(**connections.overrides)
    cycle = {
        name: params[name]
        for name in CycleConfig.model_fields
        if params.get(name) is not None and name not in _PARSE_TIME_FIELDS
    }
    gate = {
        name: params[f"gate_{name}"]
        for name in _GATE_FIELDS
        if params.get(f"gate_{name}") is not None
    }
    return base.model_copy(
        update={
            "cycle": CycleConfig.model_validate({**base.cycle.model_dump(), **cycle}),
            "gate": GateConfig.model_validate({**base.gate.model_dump(), **gate}),
        }
    )

"""Airflow plugin: mounts TIDE's dashboard at /tide and adds it to the Airflow UI's navigation."""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from tide_lib.ui.dashboard import create_app


class TidePlugin(AirflowPlugin):
    name = "tide"
    fastapi_apps: list[Any] = [  # noqa: RUF012  (Airflow reads class attributes)
        {"app": create_app(), "url_prefix": "/tide", "name": "TIDE dashboard"}
    ]
    external_views: list[Any] = [  # noqa: RUF012
        {
            "name": "TIDE",
            "href": "/tide/",
            "destination": "nav",
            "url_route": "tide",
            "category": "browse",
        }
    ]

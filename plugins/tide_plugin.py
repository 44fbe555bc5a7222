"""Airflow plugin: mounts TIDE's dashboard at /tide and adds it to the Airflow UI's navigation.

The view asks Airflow's auth manager, as Airflow's own pages do: a caller without a
valid session cookie or bearer token gets 401, one not allowed the website gets 403.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
from airflow.api_fastapi.core_api.security import requires_access_view
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends

from tide_lib.ui.dashboard import create_app


class TidePlugin(AirflowPlugin):
    name = "tide"
    fastapi_apps: list[Any] = [  # noqa: RUF012  (Airflow reads class attributes)
        {
            "app": create_app(dependencies=[Depends(requires_access_view(AccessView.WEBSITE))]),
            "url_prefix": "/tide",
            "name": "TIDE dashboard",
        }
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

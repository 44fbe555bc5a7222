"""Airflow 3's REST API as a logged-in user.

The stack's Airflow runs the simple auth manager with passwords: a client trades a
user name and password for a JWT at ``POST /auth/token`` and sends it as a bearer
token; a token that expires is renewed once. Without a password (the demo's
all-admins Airflow) no header is sent.
"""

from __future__ import annotations

__all__ = ["AirflowAPI", "AirflowAuthError"]

from typing import Any

import httpx
from pydantic import SecretStr

from tide_lib.config import TideConfig
from tide_lib.errors import TideError


class AirflowAuthError(TideError, RuntimeError):
    """Airflow refused the credentials; the message says which user and what to check."""


class AirflowAPI:
    """A small authenticated client of one Airflow API server."""

    def __init__(
        self,
        base_url: str,
        username: str = "admin",
        password: SecretStr | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.username = username
        self._password = password
        self._token: str | None = None
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    @classmethod
    def for_stack(cls, config: TideConfig, user: str = "admin") -> AirflowAPI:
        """The local stack's API server, as ``user`` (admin or viewer) when logins are on."""
        stack = config.stack
        base = stack.airflow_api_url or f"http://{stack.host}:{stack.airflow_port}"
        passwords = {"admin": stack.airflow_admin_password, "viewer": stack.airflow_viewer_password}
        return cls(base, user, passwords[user] if stack.auth else None)

    def login(self) -> str:
        """A fresh JWT for this user."""
        if self._password is None:
            raise AirflowAuthError("no password configured: this client sends no credentials")
        response = self.client.post(
            "/auth/token",
            json={"username": self.username, "password": self._password.get_secret_value()},
        )
        if response.status_code in (400, 401, 403):
            raise AirflowAuthError(
                f"Airflow at {self.base_url} refused user {self.username!r} "
                f"({response.status_code}); check TIDE_STACK__AIRFLOW_{self.username.upper()}"
                "_PASSWORD against the API server's passwords file"
            )
        response.raise_for_status()
        token: str = response.json()["access_token"]
        return token

    def _headers(self, renew: bool) -> dict[str, str]:
        if self._password is None:
            return {}
        if self._token is None or renew:
            self._token = self.login()
        return {"Authorization": f"Bearer {self._token}"}

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``method path`` with this user's token; renews the token once on a 401."""
        response = self.client.request(method, path, headers=self._headers(False), **kwargs)
        if response.status_code == 401 and self._password is not None:
            response = self.client.request(method, path, headers=self._headers(True), **kwargs)
        return response

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", path, **kwargs)

    def close(self) -> None:
        self.client.close()

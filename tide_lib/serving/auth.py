"""Bearer-key auth with SGLang's semantics (``sglang/srt/utils/auth.py``, 0.5.14 and 0.5.23).

The reference engine answers exactly as an SGLang server started with
``--api-key`` / ``--admin-api-key`` does, so the fleet client is tested against
the rules it meets in production:

- ``/health*`` and ``/metrics*`` are always open (probes and Prometheus carry no secret);
- admin routes (``/update_weights_from_disk``): the admin key when one is set, else
  the API key when one is set, else open (SGLang's ``ADMIN_OPTIONAL``); with
  ``admin_force`` (``serve.admin_key_required``, TIDE's default) SGLang's
  ``ADMIN_FORCE`` instead: the admin key only, and 403 when none is configured;
- every other route: the API key when one is set, else open.

Keys are compared in constant time. The client side is :func:`bearer_for`.
TIDE is stricter than SGLang in one place: a server bound beyond loopback must
have both keys (:func:`require_keys_off_loopback`), so an engine is never open
to the network by accident. Keys are never logged or echoed.
"""

from __future__ import annotations

__all__ = [
    "ADMIN_ROUTES",
    "InsecureBindError",
    "allowed",
    "bearer_for",
    "decide",
    "is_loopback",
    "require_keys_off_loopback",
]

import ipaddress
import secrets

from pydantic import SecretStr

from tide_lib.config import ServeConfig
from tide_lib.errors import TideError

ADMIN_ROUTES = frozenset({"/update_weights_from_disk"})
_OPEN_PREFIXES = ("/health", "/metrics")


def _matches(header: str | None, key: SecretStr) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.encode(), key.get_secret_value().encode()
    )


def _key_for(
    path: str, api_key: SecretStr | None, admin_api_key: SecretStr | None
) -> SecretStr | None:
    return (admin_api_key or api_key) if path in ADMIN_ROUTES else api_key


def decide(
    path: str,
    header: str | None,
    api_key: SecretStr | None,
    admin_api_key: SecretStr | None,
    *,
    admin_force: bool = False,
) -> int:
    """The status a request to ``path`` gets from the key check: 200 (go on), 401 or 403."""
    if path.startswith(_OPEN_PREFIXES):
        return 200
    if admin_force and path in ADMIN_ROUTES:
        if admin_api_key is None:
            return 403
        return 200 if _matches(header, admin_api_key) else 401
    key = _key_for(path, api_key, admin_api_key)
    return 200 if key is None or _matches(header, key) else 401


def allowed(
    path: str,
    header: str | None,
    api_key: SecretStr | None,
    admin_api_key: SecretStr | None,
    *,
    admin_force: bool = False,
) -> bool:
    """Whether a request to ``path`` with this ``Authorization`` header may go on."""
    return decide(path, header, api_key, admin_api_key, admin_force=admin_force) == 200


def bearer_for(
    path: str, api_key: SecretStr | None, admin_api_key: SecretStr | None
) -> dict[str, str]:
    """The ``Authorization`` header a client sends to ``path`` (none when no key applies)."""
    key = _key_for(path, api_key, admin_api_key)
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}


class InsecureBindError(TideError, ValueError):
    """A server would listen beyond loopback without its bearer keys."""


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches; a host name is never assumed to be."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_keys_off_loopback(serve: ServeConfig) -> None:
    """Refuse a non-loopback ``serve.host`` unless both the API and the admin key are set."""
    if is_loopback(serve.host) or (serve.api_key and serve.admin_api_key):
        return
    missing = [
        name
        for name, key in (
            ("TIDE_SERVE__API_KEY", serve.api_key),
            ("TIDE_SERVE__ADMIN_API_KEY", serve.admin_api_key),
        )
        if not key
    ]
    raise InsecureBindError(
        f"refusing to serve on {serve.host}, which other hosts reach, without bearer keys: "
        f"set {' and '.join(missing)} (the API key guards every route but /health and "
        "/metrics, the admin key /update_weights_from_disk), or bind 127.0.0.1"
    )

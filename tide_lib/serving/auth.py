"""Bearer-key auth with SGLang 0.5.14's semantics (``sglang/srt/utils/auth.py``).

The reference engine answers exactly as an SGLang server started with
``--api-key`` / ``--admin-api-key`` does, so the fleet client is tested against
the rules it meets in production:

- ``/health*`` and ``/metrics*`` are always open (probes and Prometheus carry no secret);
- admin routes (``/update_weights_from_disk``): the admin key when one is set, else
  the API key when one is set, else open;
- every other route: the API key when one is set, else open.

Keys are compared in constant time. The client side is :func:`bearer_for`.
"""

from __future__ import annotations

import secrets

from pydantic import SecretStr

__all__ = ["ADMIN_ROUTES", "allowed", "bearer_for"]

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


def allowed(
    path: str, header: str | None, api_key: SecretStr | None, admin_api_key: SecretStr | None
) -> bool:
    """Whether a request to ``path`` with this ``Authorization`` header may go on."""
    if path.startswith(_OPEN_PREFIXES):
        return True
    key = _key_for(path, api_key, admin_api_key)
    return key is None or _matches(header, key)


def bearer_for(
    path: str, api_key: SecretStr | None, admin_api_key: SecretStr | None
) -> dict[str, str]:
    """The ``Authorization`` header a client sends to ``path`` (none when no key applies)."""
    key = _key_for(path, api_key, admin_api_key)
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}

"""Draft URIs that every host resolves on its own.

Hosts share only the network, so a draft travels between them as a URI, never as
a local path: ``models:/tide-draft-<slug>/<version>`` (or an alias),
``models:/<logged model id>`` (what a training run logs), ``runs:/<run id>/draft``
and ``mlflow-artifacts:/...`` resolve through the MLflow server;
``s3://bucket/prefix`` through the object store with this host's credentials.
:func:`fetch_draft` downloads one into a directory the caller owns (and removes),
so a host keeps no copy it did not ask for.
"""

from __future__ import annotations

__all__ = [
    "MLFLOW_SCHEMES",
    "PORTABLE_SCHEMES",
    "DraftFetchError",
    "fetch_draft",
    "is_portable",
    "logged_model_id",
    "logged_model_uri",
    "object_destination",
]

import logging
import re
from pathlib import Path
from typing import Final

from tide_lib.config import TideConfig
from tide_lib.errors import TideError

logger = logging.getLogger(__name__)

MLFLOW_SCHEMES: Final = ("runs:/", "models:/", "mlflow-artifacts:/")
PORTABLE_SCHEMES: Final = ("s3://", *MLFLOW_SCHEMES)


class DraftFetchError(TideError, ValueError):
    """A draft URI names nothing that can be downloaded."""


def is_portable(uri: str) -> bool:
    """True for a URI every host resolves on its own (no local filesystem path)."""
    return uri.startswith(PORTABLE_SCHEMES)


def fetch_draft(uri: str, config: TideConfig, dest: Path) -> Path:
    """Download the draft at ``uri`` into ``dest`` (created); returns the draft directory."""
    dest.mkdir(parents=True, exist_ok=True)
    if uri.startswith(MLFLOW_SCHEMES):
        import mlflow.artifacts  # noqa: PLC0415
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        tracking = config.mlflow.tracking_uri
        try:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=_model_source(uri, tracking), dst_path=str(dest), tracking_uri=tracking
            )
        except (MlflowException, OSError) as error:
            raise DraftFetchError(f"cannot download draft {uri}: {error}") from error
        return Path(local)
    if uri.startswith("s3://"):
        try:
            return _fetch_s3(uri, config, dest)
        except DraftFetchError:
            raise
        except Exception as error:  # the store's own errors: unreachable, no such bucket, ...
            raise DraftFetchError(f"cannot download draft {uri}: {error}") from error
    raise DraftFetchError(
        f"{uri!r} is not a draft URI (expected one of {', '.join(PORTABLE_SCHEMES)})"
    )


_LOGGED_MODEL = re.compile(r"models:/(m-[0-9a-f]{32})/?")


def logged_model_uri(model_id: str) -> str:
    """``models:/<model id>``: MLflow 3's URI of a logged model."""
    return f"models:/{model_id}"


def logged_model_id(uri: str) -> str | None:
    """The logged model id in ``models:/m-<hex>``, else None (a registered model's URI)."""
    match = _LOGGED_MODEL.fullmatch(uri)
    return match[1] if match else None


def _model_source(uri: str, tracking_uri: str) -> str:
    """``models:/name/<version or alias>`` (or ``models:/<logged model id>``) as the
    artifact URI behind it, from the server.

    MLflow resolves ``models:/`` against its *registry* URI, a process-wide setting;
    asking the configured server directly keeps this host's setting out of it.
    """
    if not uri.startswith("models:/"):
        return uri
    from mlflow import MlflowClient  # noqa: PLC0415

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    model_id = logged_model_id(uri)
    if model_id is not None:  # resolved here too: MLflow would ask its process-wide server
        return str(client.get_logged_model(model_id).artifact_location)
    name, _, version = uri.removeprefix("models:/").rstrip("/").rpartition("/")
    if not name or not version:
        raise DraftFetchError(f"{uri!r} is not models:/<name>/<version or alias>")
    if not version.isdigit():
        version = str(client.get_model_version_by_alias(name, version).version)
    return str(client.get_model_version_download_uri(name, version))


def object_destination(dest: Path, key: str, prefix: str) -> Path:
    """Where object ``key`` (under ``prefix``) lands in ``dest``; keys that escape are refused.

    An object store hands back whatever keys a writer chose: an absolute one, or one
    with ``..`` or empty segments, would write outside ``dest`` or somewhere surprising.
    """
    relative = key[len(prefix) :] if key.startswith(prefix) else ""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or any(p in {"", ".", ".."} for p in parts):
        raise DraftFetchError(
            f"object key {key!r} would land outside the draft directory; remove it from the "
            "store or publish the draft under a clean prefix"
        )
    destination = (dest / relative).resolve()
    if not destination.is_relative_to(dest.resolve()):
        raise DraftFetchError(f"object key {key!r} would land outside {dest}")
    return destination


def _fetch_s3(uri: str, config: TideConfig, dest: Path) -> Path:
    from tide_lib.lake.store import ObjectStore  # noqa: PLC0415

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/"
    store = ObjectStore(config.store, bucket)
    found = False
    for info in store.list(prefix):
        destination = object_destination(dest, info.key, prefix)
        destination.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(info.key, destination)
        found = True
    if not found:
        raise DraftFetchError(f"no objects under {uri}")
    return dest

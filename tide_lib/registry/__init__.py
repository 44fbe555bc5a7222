"""The MLflow registry of drafts: one registered model per target, aliases, lineage tags.

``tide-draft-<target-slug>`` holds every draft TIDE trained for a target. Aliases
(never the deprecated stages) say what each version is: ``champion`` (serving),
``challenger`` (candidate), ``previous-champion`` (rollback). Lineage lives in
version tags under ``tide.``. A version is only ever created for a checkpoint
that passed :func:`~tide_lib.training.draft.validate_draft_dir`, and its weights
are the artifacts of the training run, stored in the object store behind the
MLflow server. Registration is idempotent per training cycle: a rerun finds the
version it registered before instead of adding a second one.
"""

from __future__ import annotations

__all__ = [
    "BASELINE",
    "CHALLENGER",
    "CHAMPION",
    "DRAFT_MODEL_TYPE",
    "PREVIOUS_CHAMPION",
    "DraftRegistry",
    "DraftVersion",
    "registered_model_name",
]

import dataclasses
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tide_lib.names import (
    BASELINE,
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    Tags,
    registered_model_name,
)
from tide_lib.registry.uris import is_portable, logged_model_id, logged_model_uri
from tide_lib.training.draft import validate_draft_dir

logger = logging.getLogger(__name__)

DRAFT_ARTIFACT_PATH = "draft"
DRAFT_MODEL_TYPE = "eagle3-draft"  # the logged model's type: an SGLang EAGLE3 checkpoint


@dataclasses.dataclass(frozen=True)
class DraftVersion:
    name: str
    version: str
    run_id: str | None
    tags: dict[str, str]
    aliases: list[str]
    source: str = ""  # what it was registered from: models:/<logged model id>
    created_ms: int = 0  # creation time, milliseconds since the epoch


class DraftRegistry:
    """A thin layer over ``MlflowClient`` for draft versions of one target."""

    def __init__(self, tracking_uri: str, target_id: str) -> None:
        from mlflow import MlflowClient  # noqa: PLC0415

        self.client = MlflowClient(tracking_uri)
        self.tracking_uri = tracking_uri
        self.target_id = target_id
        self.name = registered_model_name(target_id)

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(
                self.name,
                tags={Tags.TARGET_ID: self.target_id},
                description=f"EAGLE3 drafts of {self.target_id}, trained by TIDE on its traffic.",
            )

    def _version(self, raw: Any) -> DraftVersion:
        return DraftVersion(
            name=raw.name,
            version=str(raw.version),
            run_id=raw.run_id,
            tags=dict(raw.tags or {}),
            aliases=list(getattr(raw, "aliases", []) or []),
            source=str(raw.source or ""),
            created_ms=int(raw.creation_timestamp or 0),
        )

    def versions(self, last: int | None = None) -> list[DraftVersion]:
        """Every version (or the ``last`` ones), oldest first, with tags and aliases."""
        found = self.client.search_model_versions(f"name = '{self.name}'")
        numbers = sorted(int(raw.version) for raw in found)
        return [self.get(str(number)) for number in numbers[-last if last else 0 :]]

    def logged_metrics(self, version: DraftVersion) -> dict[str, float]:
        """The metrics logged for ``version``: its logged model's of that version's step,
        else (a version registered from a run's artifacts) its run's latest."""
        model_id = logged_model_id(version.source)
        if model_id:
            step = int(version.version)
            logged = self.client.get_logged_model(model_id).metrics or []
            return {m.key: m.value for m in logged if m.step == step}
        if version.run_id:
            return dict(self.client.get_run(version.run_id).data.metrics)
        return {}

    def log_version_metrics(self, version: DraftVersion, metrics: dict[str, float]) -> None:
        """Log figures of ``version`` on its run and its logged model, step = the version
        number, so the MLflow UI charts them across versions (:meth:`logged_metrics` reads
        them back). A version without a run has nowhere to hold them: nothing is logged."""
        from mlflow.entities import Metric  # noqa: PLC0415

        if not version.run_id:
            return
        now, step = int(time.time() * 1000), int(version.version)
        model_id = logged_model_id(version.source)
        batch = [Metric(key, value, now, step, model_id=model_id) for key, value in metrics.items()]
        self.client.log_batch(version.run_id, metrics=batch)

    def log_version_text(self, version: DraftVersion, text: str, artifact_file: str) -> None:
        """A text artifact (a report) on ``version``'s run, if it has one."""
        if version.run_id:
            self.client.log_text(version.run_id, text, artifact_file)

    def find_by_tag(self, key: str, value: str) -> DraftVersion | None:
        """The version tagged ``key=value``, found by the server's filter (not client-side)."""
        quote = "'" if "'" not in value else '"'
        if quote in value or "`" in key:
            raise ValueError(f"cannot search for tag {key}={value!r}: it holds both quotes")
        found = self.client.search_model_versions(
            f"name = '{self.name}' and tags.`{key}` = {quote}{value}{quote}"
        )
        return self.get(found[0].version) if found else None  # with aliases (search omits)

    def log_dataset(
        self, run_id: str, *, name: str, uri: str, digest: str, profile: dict[str, Any]
    ) -> None:
        """Record what a training run read as its MLflow dataset input (context
        ``training``): the lake's object URI, a digest and figures such as token counts."""
        from mlflow.entities import Dataset, DatasetInput, InputTag  # noqa: PLC0415

        dataset = Dataset(
            name=name,
            digest=digest,
            source_type="s3",
            source=json.dumps({"uri": uri}),
            profile=json.dumps(profile),
        )
        context = InputTag("mlflow.data.context", "training")
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset, [context])])

    def log_draft(self, run_id: str, draft_dir: Path) -> str:
        """Validate ``draft_dir`` and log it as an MLflow 3 logged model of the run (its
        artifacts are the SGLang checkpoint as is); returns ``models:/<model id>``.

        The artifacts land in the object store behind the MLflow server, so any host
        resolves the URI; the caller's directory can go as soon as this returns.
        """
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus  # noqa: PLC0415

        validate_draft_dir(draft_dir)
        experiment_id = self.client.get_run(run_id).info.experiment_id
        model = self.client.create_logged_model(
            experiment_id,
            name=DRAFT_ARTIFACT_PATH,
            source_run_id=run_id,
            model_type=DRAFT_MODEL_TYPE,
        )
        try:
            self.client.log_model_artifacts(model.model_id, str(draft_dir))
        except BaseException:  # never left PENDING: marked failed, the retry logs a new one
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self.client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
        return logged_model_uri(model.model_id)

    def register(
        self,
        draft: Path | str,
        run_id: str,
        *,
        cycle_id: str,
        tags: dict[str, str] | None = None,
    ) -> DraftVersion:
        """Register a draft as ``challenger`` (once per cycle).

        ``draft`` is a local directory (validated and logged to the run first) or the
        URI :meth:`log_draft` returned on another host.
        """
        existing = self.find_by_tag(Tags.CYCLE_ID, cycle_id)
        if existing is not None:
            logger.info("cycle %s already registered %s v%s", cycle_id, self.name, existing.version)
            latest = self.versions(last=1)[-1].version
            if CHALLENGER not in existing.aliases and existing.version == latest:
                # a retry after the version was created but before the alias was set
                self.client.set_registered_model_alias(self.name, CHALLENGER, existing.version)
                return self.get(existing.version)
            return existing
        if isinstance(draft, Path):
            source = self.log_draft(run_id, draft)
        elif is_portable(draft):
            source = draft
        else:
            raise ValueError(f"register takes a draft directory or a draft URI, not {draft!r}")
        self._ensure_model()
        raw = self.client.create_model_version(
            self.name,
            source,
            run_id=run_id,
            tags={Tags.CYCLE_ID: cycle_id, **(tags or {})},
            model_id=logged_model_id(source),  # registered from the logged model, if one
        )
        self.client.set_registered_model_alias(self.name, CHALLENGER, raw.version)
        logger.info("registered %s v%s (challenger) from run %s", self.name, raw.version, run_id)
        return self.get(raw.version)

    def model_uri(self, version: str) -> str:
        """``models:/<name>/<version>``: what a host is handed to fetch this version itself."""
        return f"models:/{self.name}/{version}"

    def experiment_id(self) -> str:
        """The MLflow experiment of this target's runs (named like the model), created once."""
        experiment = self.client.get_experiment_by_name(self.name)
        return str(
            experiment.experiment_id if experiment else self.client.create_experiment(self.name)
        )

    def cycle_run(self, cycle_id: str) -> tuple[str, str | None]:
        """The cycle's MLflow run and the version it warm-starts from.

        A retry reuses both (one run per cycle, never one left RUNNING; the parent its
        checkpoints were trained from, even if the champion moved in between).
        """
        experiment = self.experiment_id()
        runs = self.client.search_runs(
            [experiment],
            filter_string=f"tags.`{Tags.CYCLE_ID}` = '{cycle_id}'",
            order_by=["attributes.start_time ASC"],
        )
        if runs:
            kept, *strays = runs
            for stray in strays:  # attempts that raced the first one: never left RUNNING
                if stray.info.status == "RUNNING":
                    self.end_run(str(stray.info.run_id), "KILLED")
            run_id = str(kept.info.run_id)
            if kept.info.status != "RUNNING":  # an earlier attempt failed: this one resumes it
                self.client.update_run(run_id, status="RUNNING")
            logger.info("cycle %s: continuing its MLflow run %s", cycle_id, run_id)
            return run_id, kept.data.tags.get(Tags.PARENT_VERSION) or None
        champion = self.alias(CHAMPION)
        parent = champion.version if champion else None
        run = self.client.create_run(
            experiment,
            run_name=f"cycle-{cycle_id}",
            tags={Tags.CYCLE_ID: cycle_id, Tags.PARENT_VERSION: parent or ""},
        )
        return str(run.info.run_id), parent

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End a run; where that fails on a FAILED/KILLED path, log it (the caller's own
        error is the one to report) instead of raising."""
        try:
            self.client.set_terminated(run_id, status)
        except Exception as error:
            if status == "FINISHED":
                raise
            logger.error("could not mark MLflow run %s %s: %s", run_id, status, error)

    def run_tags(self, run_id: str) -> dict[str, str]:
        return dict(self.client.get_run(run_id).data.tags)

    def record_run(self, run_id: str, *, params: dict[str, Any], tags: dict[str, str]) -> None:
        """Log ``params`` on a run, then set ``tags`` in their order.

        Idempotent for a retried task: MLflow refuses to change a logged param, so a
        param already on the run is kept (and a different value is logged as a warning:
        a retry that saw the lake after retention may count other requests).
        """
        logged = dict(self.client.get_run(run_id).data.params)
        for key, value in params.items():
            if key not in logged:
                self.client.log_param(run_id, key, value)
            elif logged[key] != str(value):
                logger.warning(
                    "run %s keeps param %s=%s (a retry measured %s)",
                    run_id,
                    key,
                    logged[key],
                    value,
                )
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)

    def last_run_seconds(self) -> float | None:
        """How long this target's latest finished run took (None if unknown): what a
        skipped cycle saves. A figure for the log: a failure to read it is logged only."""
        try:
            runs = self.client.search_runs(
                [self.experiment_id()],
                filter_string="attributes.status = 'FINISHED'",
                order_by=["attributes.end_time DESC"],
                max_results=1,
            )
        except Exception as error:
            logger.warning("could not read the last training run's time: %s", error)
            return None
        if not runs or not runs[0].info.end_time:
            return None
        return float(runs[0].info.end_time - runs[0].info.start_time) / 1000

    def seed_champion(self, draft_dir: Path, cycle_id: str = "static") -> DraftVersion:
        """Register a draft trained outside any cycle (a static draft) and make it champion."""
        run_id = self.client.create_run(self.experiment_id(), run_name=cycle_id).info.run_id
        version = self.register(draft_dir, run_id, cycle_id=cycle_id)
        self.promote(version.version)
        return version

    def get(self, version: str) -> DraftVersion:
        return self._version(self.client.get_model_version(self.name, version))

    def find(self, version: str) -> DraftVersion | None:
        """``version``, or None when it is gone (retention deleted it) or never was; any
        other registry error is raised."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        try:
            return self.get(version)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def alias(self, alias: str) -> DraftVersion | None:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        try:
            return self._version(self.client.get_model_version_by_alias(self.name, alias))
        except MlflowException:
            return None

    def promote(self, version: str) -> None:
        """``champion`` -> ``version``; the champion it replaces becomes ``previous-champion``.

        ``baseline`` (the gate's floor, see ``gate.floor``) is set once, on the first
        champion; an operator moves it to re-anchor the floor (or sets it on a registry
        whose first champion came before it existed: a rollback must not set it).

        Idempotent: promoting the champion again only finishes what an interrupted
        promotion left undone (its ``tide.promoted`` tag).
        """
        current = self.alias(CHAMPION)
        if current is not None and current.version == version:
            if current.tags.get(Tags.PROMOTED) != "true":
                self.client.set_model_version_tag(self.name, version, Tags.PROMOTED, "true")
            return
        if current is None and self.alias(BASELINE) is None:  # the gate's floor
            self.client.set_registered_model_alias(self.name, BASELINE, version)
        if current is not None:
            self.client.set_registered_model_alias(self.name, PREVIOUS_CHAMPION, current.version)
        self.client.set_registered_model_alias(self.name, CHAMPION, version)
        self.client.set_model_version_tag(self.name, version, Tags.PROMOTED, "true")
        logger.info("%s: champion is now v%s", self.name, version)

    def set_tags(self, version: str, tags: dict[str, str]) -> None:
        """Set version tags, in their order."""
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, version, key, value)

    def delete_tags(self, version: str, keys: Iterable[str]) -> None:
        """Remove version tags (those absent are skipped)."""
        for key in keys:
            self.client.delete_model_version_tag(self.name, version, key)

    def download(self, version: str, out_dir: Path) -> Path:
        """The version's validated draft directory, downloaded from the artifact store."""
        import mlflow.artifacts  # noqa: PLC0415

        # the server resolves a logged model's source (models:/<id>) to its artifacts
        location = self.client.get_model_version_download_uri(self.name, version)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=location, dst_path=str(out_dir), tracking_uri=self.tracking_uri
            )
        )
        validate_draft_dir(path)
        return path

"""Training on a trainer host: one process per accelerator, checkpoints mirrored to S3.

A cycle's ``train`` step runs on whichever ``mi250`` worker picks it up, and a
retry may land on another host. So the periodic training checkpoints are copied
to the object store as they are written (rank 0, right after the local save),
and a new attempt first pulls the latest one back: it resumes where the last
attempt stopped, on any host. The resume check (the run fingerprint) depends on
the samples' names, the settings and the parent's weights, never on a host's
paths.

With ``training.nproc_per_node`` above 1 the job runs under ``torchrun`` (DDP;
NCCL/RCCL on GPUs, gloo on CPU); each process takes its share of every step's
samples, so N processes with batch B train exactly what one process with batch
N x B would. The job description travels to the workers as a JSON file holding
no secret: credentials stay in the environment the workers inherit.

Run ``python -m tide_lib.training.launch JOB.json`` (what ``torchrun`` starts).
"""

from __future__ import annotations

__all__ = ["CheckpointMirror", "TrainJob", "run_training"]

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from tide_lib.config import TideConfig, TrainConfig, load_config
from tide_lib.training.trainer import CHECKPOINT_DIR, TrainResult, train_draft

logger = logging.getLogger(__name__)

RESULT_FILE = "result.json"


class TrainJob(BaseModel):
    """One training job on this host: local inputs, and where its checkpoints are mirrored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path
    target_dir: Path
    out_dir: Path
    training: TrainConfig
    parent_dir: Path | None = None
    start_dir: Path | None = None  # a continuation of an earlier run on this parent
    checkpoint_prefix: str | None = None  # key prefix in the lake bucket
    mlflow_run_id: str | None = None


class CheckpointMirror:
    """Copies of a run's training checkpoints under one key prefix of the object store."""

    def __init__(self, config: TideConfig, prefix: str, keep: int) -> None:
        from tide_lib.lake.store import ObjectStore  # noqa: PLC0415

        self.store = ObjectStore(config.store, config.store.lake_bucket)
        self.prefix = prefix.rstrip("/") + "/"
        self.keep = keep

    def stored(self) -> list[str]:
        return sorted(info.key for info in self.store.list(self.prefix) if info.key.endswith(".pt"))

    def push(self, path: Path) -> None:
        """Upload a checkpoint just written, then drop mirrored ones beyond ``keep``."""
        self.store.put_file(self.prefix + path.name, path)
        for old in self.stored()[: -self.keep]:
            self.store.remove(old)
        logger.info("checkpoint %s mirrored to %s", path.name, self.prefix)

    def pull(self, directory: Path) -> Path | None:
        """Download the latest mirrored checkpoint into ``directory`` (a retry resumes from it)."""
        keys = self.stored()
        if not keys:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / keys[-1].rsplit("/", 1)[-1]
        self.store.get_file(keys[-1], path.with_suffix(".part"))
        path.with_suffix(".part").replace(path)
        logger.info("resuming from the mirrored checkpoint %s", keys[-1])
        return path

    def clear(self) -> None:
        for key in self.stored():
            self.store.remove(key)


def _mirror(config: TideConfig, job: TrainJob) -> CheckpointMirror | None:
    if job.checkpoint_prefix is None:
        return None
    return CheckpointMirror(config, job.checkpoint_prefix, job.training.keep_checkpoints)


def _train_here(job: TrainJob, config: TideConfig) -> TrainResult:
    """Train in this process (rank 0 of 1, or one rank under torchrun)."""
    from tide_lib.training.tracking import MlflowMetricSink  # noqa: PLC0415

    mirror = _mirror(config, job)
    rank = int(os.environ.get("RANK", "0"))
    sink = (
        MlflowMetricSink(config.mlflow.tracking_uri, job.mlflow_run_id)
        if job.mlflow_run_id and rank == 0
        else None
    )
    return train_draft(
        job.data_dir,
        job.target_dir,
        job.out_dir,
        job.training,
        parent_dir=job.parent_dir,
        start_dir=job.start_dir,
        metrics=sink,
        on_checkpoint=mirror.push if mirror is not None and rank == 0 else None,
        on_stale_checkpoint=mirror.clear if mirror is not None and rank == 0 else None,
    )


def run_training(job: TrainJob, config: TideConfig) -> TrainResult:
    """Resume from the mirrored checkpoint if there is one, then train on this host."""
    mirror = _mirror(config, job)
    if mirror is not None:
        mirror.pull(job.out_dir / CHECKPOINT_DIR)
    if job.training.nproc_per_node == 1:
        return _train_here(job, config)
    return _torchrun(job)


def _torchrun(job: TrainJob) -> TrainResult:
    job.out_dir.mkdir(parents=True, exist_ok=True)
    spec = job.out_dir / "job.json"
    spec.write_text(job.model_dump_json(), encoding="utf-8")
    result_path = job.out_dir / RESULT_FILE
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(job.training.nproc_per_node),
        "-m",
        "tide_lib.training.launch",
        str(spec),
    ]
    logger.info("launching %d training processes with torchrun", job.training.nproc_per_node)
    process = subprocess.Popen(command)
    try:
        returncode = process.wait()
    except BaseException:  # a task timeout or SIGTERM: torchrun stops its workers on SIGTERM
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    if returncode != 0 or not result_path.is_file():
        raise RuntimeError(
            f"torchrun with {job.training.nproc_per_node} processes failed (exit "
            f"{returncode}); the worker logs above name the failing rank"
        )
    return TrainResult.from_json(result_path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of each torchrun worker: ``python -m tide_lib.training.launch JOB.json``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = argv if argv is not None else sys.argv[1:]
    job = TrainJob.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    try:
        result = _train_here(job, load_config())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        (job.out_dir / RESULT_FILE).write_text(result.to_json(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tide demo``: TIDE's loop on one machine, run by the real Airflow scheduler.

1. Build (or reuse) the demo target and a static draft trained on the target's
   own answers to English prompts; register the static draft as champion.
2. Start the stack (S3, MLflow, Airflow) with this demo's cycle settings, and a
   fleet of reference engines serving the static draft with capture on.
3. Replay Korean conversation prompts against the fleet, round robin.
4. Trigger ``tide_adaptation`` runs; the scheduler runs them: the deferrable
   sensor waits until enough new tokens are captured, then snapshot, train on
   the ``mi250`` pool, register, gate and promote to every engine.
5. Every few seconds print a row: cycle, tokens captured, the acceptance length
   of the serving draft on live traffic, and that of the static draft on the
   same requests (replayed offline from the captured states: exact for greedy).
6. At the end write a JSON summary and a PNG of acceptance length over time.
"""

from __future__ import annotations

__all__ = ["DemoSettings", "run_demo"]

import contextlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tide_lib.config import TideConfig, TrainConfig, secrets_dir
from tide_lib.harness.params import DemoSettings
from tide_lib.names import Tags
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.stack.airflow_api import AirflowAPI

logger = logging.getLogger(__name__)
_COMMIT_SETTLE_S = 15.0  # one local store: markers land in milliseconds, not minutes
DAG_ID = "tide_adaptation"
_AIRFLOW_SERVICES = ("airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what this process starts; restore them afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _static_draft(
    target_dir: Path, work_dir: Path, settings: DemoSettings, train: TrainConfig
) -> Path:
    """The draft trained on English only, cached: TIDE starts from it."""
    from tide_lib.harness.serve_bench import bootstrap_draft  # noqa: PLC0415
    from tide_lib.target_model import load_corpus, render_prompt  # noqa: PLC0415
    from tide_lib.training.draft import InvalidCheckpointError, validate_draft_dir  # noqa: PLC0415

    cached = work_dir / f"static-{settings.preset}" / "bootstrap-run" / "draft"
    with contextlib.suppress(InvalidCheckpointError, FileNotFoundError):
        validate_draft_dir(cached)
        logger.info("reusing the static English draft in %s", cached)
        return cached
    documents = load_corpus().domain("en_chat", held_out=False)[: settings.static_prompts]
    prompts = [render_prompt(document.turns[0]) for document in documents]
    return bootstrap_draft(
        target_dir,
        prompts,
        work_dir / f"static-{settings.preset}",
        max_new_tokens=settings.max_new_tokens,
        train=train,
    )


class _Traffic(threading.Thread):
    """Korean conversation prompts, one request at a time, round robin over the fleet."""

    def __init__(self, servers: list[str], prompts: list[str], settings: DemoSettings) -> None:
        super().__init__(name="tide-demo-traffic", daemon=True)
        self.servers = servers
        self.prompts = prompts
        self.settings = settings
        self.stop = threading.Event()
        self.sent = 0
        self.served = 0
        self.failed = 0

    def run(self) -> None:
        order = list(range(len(self.prompts)))
        random.Random(0).shuffle(order)
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                prompt = self.prompts[order[self.sent % len(order)]]
                server = self.servers[self.sent % len(self.servers)]
                self.sent += 1
                body = {
                    "text": prompt,
                    "sampling_params": {"max_new_tokens": self.settings.max_new_tokens},
                }
                try:
                    client.post(f"{server}/generate", json=body).raise_for_status()
                    self.served += 1
                except httpx.HTTPError as error:
                    self.failed += 1
                    logger.warning("request to %s failed: %s", server, error)
                self.stop.wait(self.settings.request_pause_s)


class _Airflow:
    """The few REST calls the demo makes, logged in as the stack's admin."""

    def __init__(self, config: TideConfig) -> None:
        self.base = f"/api/v2/dags/{DAG_ID}"
        self.client = AirflowAPI.for_stack(config)

    def wait_for_dag(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get(self.base).status_code == 200:
                    return
            time.sleep(3)
        raise TimeoutError(f"Airflow did not load {DAG_ID} in {timeout_s:.0f} s")

    def runs(self) -> list[dict[str, Any]]:
        response = self.client.get(f"{self.base}/dagRuns", params={"limit": 50, "order_by": "-id"})
        response.raise_for_status()
        runs: list[dict[str, Any]] = response.json()["dag_runs"]
        return runs

    def trigger(self, conf: dict[str, Any]) -> str:
        response = self.client.post(
            f"{self.base}/dagRuns", json={"logical_date": None, "conf": conf}
        )
        response.raise_for_status()
        run_id: str = response.json()["dag_run_id"]
        return run_id

    def fail(self, run_id: str) -> None:
        self.client.patch(f"{self.base}/dagRuns/{run_id}", json={"state": "failed"})

    def current_task(self, run_id: str) -> str:
        response = self.client.get(f"{self.base}/dagRuns/{run_id}/taskInstances")
        if response.status_code != 200:
            return "?"
        active = [
            f"{ti['task_id']} ({ti['state']})"
            for ti in response.json()["task_instances"]
            if ti["state"] in ("running", "deferred", "queued", "scheduled", "up_for_retry")
        ]
        return ", ".join(active) or "starting"


class _Meter:
    """Acceptance lengths of newly captured requests: live (serving) and offline (static)."""

    def __init__(
        self, config: TideConfig, target_id: str, target_dir: Path, static_dir: Path, k: int
    ) -> None:
        from tide_lib.lake import LakeReader, ObjectStore, target_slug  # noqa: PLC0415
        from tide_lib.training.draft import load_draft  # noqa: PLC0415

        lake = config.lake.model_copy(update={"commit_settle_s": _COMMIT_SETTLE_S})
        self.reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), lake)
        self.slug = target_slug(target_id)
        self.target_dir = target_dir
        self.static = load_draft(static_dir, target_dir)
        self.k = k
        self.after: str | None = None

    def tokens(self) -> int:
        return self.reader.count_tokens(self.slug)

    def measure(self) -> dict[str, Any] | None:
        """Figures of the requests captured since the last call (None when there are none)."""
        from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415

        shards = self.reader.list_shards(self.slug, after=self.after, settled=True)
        if not shards:
            return None
        samples = list(self.reader.iter_records(shards))
        self.after = shards[-1].key  # only once read: a store hiccup retries them next time
        serving = AcceptanceCount(keep_requests=False)
        for sample in samples:
            serving.add_accepted(sample.spec_accept_tokens, sample.spec_verify_ct)
        if not serving.verify_steps:
            return None
        static = offline_acceptance(self.static, self.target_dir, {"new": samples}, [self.k])
        return {
            "requests": len(samples),
            "serving": serving.accept_length,
            "static": static["new"][self.k].accept_length,
            "versions": sorted({sample.draft_version for sample in samples}),
        }


def _restart_airflow(manager: Any) -> None:
    """Airflow processes already running read other settings: restart them with the demo's."""
    running = {status.name for status in manager.status() if status.running}
    for name in _AIRFLOW_SERVICES:
        if name in running:
            logger.info("restarting %s with the demo's settings", name)
            manager.stop_service(name)


def run_demo(
    config: TideConfig,
    settings: DemoSettings,
    *,
    target_dir: Path,
    work_dir: Path,
    out_json: Path,
    out_png: Path,
    say: Any = print,
) -> dict[str, Any]:
    """Run the demo to the end (``settings.cycles`` cycles); returns the JSON summary.

    The stack is left running (the caller stops it); the engines are stopped.
    """
    from tide_lib.registry import DraftRegistry  # noqa: PLC0415
    from tide_lib.serving.process import EngineProcess  # noqa: PLC0415
    from tide_lib.stack import StackManager, free_ports  # noqa: PLC0415
    from tide_lib.target_model import build_target, load_corpus, render_prompt  # noqa: PLC0415

    started = time.monotonic()
    build_target(target_dir, preset_name=settings.preset)
    train = settings.training(config.training)
    say("static draft: trained on the target's answers to English prompts (cached) ...")
    static_dir = _static_draft(target_dir, work_dir, settings, train)

    demo_started = datetime.now(UTC)
    target_id = f"demo-{demo_started:%Y%m%d-%H%M%S}"
    ports = free_ports(settings.engines, settings.engine_port)
    servers = [f"http://127.0.0.1:{port}" for port in ports]
    cycle_conf: dict[str, Any] = {
        "target_id": target_id,
        "target_path": str(target_dir.resolve()),
        "servers": servers,
        "min_new_tokens": settings.tokens_per_cycle,
        "force_promote": settings.force_promote,
    }
    engines: list[EngineProcess] = []
    traffic: _Traffic | None = None
    with _environment(_airflow_environment(cycle_conf, settings, train)):
        manager = StackManager(config)
        _restart_airflow(manager)
        manager.up()
        airflow_url = f"http://{config.stack.host}:{config.stack.airflow_port}"
        if config.stack.auth:
            say(
                f"Airflow and MLflow ask for a login: user admin, passwords in "
                f"{secrets_dir()}/TIDE_STACK__AIRFLOW_ADMIN_PASSWORD and "
                "MLFLOW_TRACKING_PASSWORD (or your environment)"
            )
        mlflow_url = config.mlflow.tracking_uri
        registry = DraftRegistry(mlflow_url, target_id)
        static = registry.seed_champion(static_dir)
        static_version = f"{registry.name}-v{static.version}"
        try:
            say(f"starting {settings.engines} engines serving {static_version} with capture ...")
            launch = ["--speculative-draft-model-path", str(static_dir)]
            launch += ["--speculative-num-steps", str(settings.num_steps)]
            launch += ["--served-model-name", target_id, "--weight-version", static_version]
            for port in ports:  # one at a time: those started are stopped on a failure
                engines.append(_start_engine(config, target_dir, port, launch, work_dir))
            airflow = _Airflow(manager.config)
            airflow.wait_for_dag()
            _fail_leftover_runs(airflow, demo_started, say)
            korean = load_corpus().domain("ko_chat", held_out=False)
            traffic = _Traffic(servers, [render_prompt(d.turns[0]) for d in korean], settings)
            traffic.start()
            traffic_started = time.monotonic()
            meter = _Meter(config, target_id, target_dir, static_dir, settings.num_steps)
            driver = _Driver(settings, airflow, meter, registry)
            summary = driver.run(servers, cycle_conf, traffic_started, say)
        finally:
            if traffic is not None:
                traffic.stop.set()
                traffic.join(timeout=300)
            for engine in engines:
                engine.stop()
    summary.update(
        {
            "target_id": target_id,
            "preset": settings.preset,
            "k": settings.num_steps,
            "static_version": static_version,
            "requests_served": traffic.served if traffic else 0,
            "requests_failed": traffic.failed if traffic else 0,
            "minutes_total": (time.monotonic() - started) / 60,
            "settings": settings.model_dump(),
            "urls": {"airflow": airflow_url, "mlflow": mlflow_url},
        }
    )
    _write_summary(summary, settings, out_json, out_png)
    return summary


def _airflow_environment(
    cycle_conf: dict[str, Any], settings: DemoSettings, train: TrainConfig
) -> dict[str, str]:
    """The cycle's settings as the environment of Airflow's processes: a run the schedule
    starts (from these defaults) and a triggered one (conf) do the same."""
    return {
        "TIDE_CYCLE__TARGET_ID": cycle_conf["target_id"],
        "TIDE_CYCLE__TARGET_PATH": cycle_conf["target_path"],
        "TIDE_CYCLE__SERVERS": json.dumps(cycle_conf["servers"]),
        "TIDE_CYCLE__MIN_NEW_TOKENS": str(settings.tokens_per_cycle),
        "TIDE_CYCLE__FORCE_PROMOTE": str(settings.force_promote).lower(),
        "TIDE_TRAINING__STEPS": str(train.steps),
        "TIDE_TRAINING__TTT_LENGTH": str(train.ttt_length),
        "TIDE_TRAINING__LEARNING_RATE": str(train.learning_rate),
        "TIDE_TRAINING__DRAFT_VOCAB_SIZE": str(train.draft_vocab_size),
        "TIDE_GATE__K": str(settings.num_steps),
        "TIDE_LAKE__SHARD_MAX_AGE_S": "2",
        "TIDE_LAKE__COMMIT_SETTLE_S": str(_COMMIT_SETTLE_S),
    }


def _start_engine(
    config: TideConfig, target_dir: Path, port: int, launch: list[str], work_dir: Path
) -> Any:
    """One reference engine with capture into the stack's lake; its log under work_dir."""
    from tide_lib.serving.process import EngineProcess  # noqa: PLC0415

    return EngineProcess.start(
        target_dir,
        port,
        launch,
        work_dir / "logs" / f"engine-{port}.log",
        {
            "TIDE_STORE__ENDPOINT": config.store.endpoint,
            "TIDE_MLFLOW__TRACKING_URI": config.mlflow.tracking_uri,
            "TIDE_LAKE__SPOOL_DIR": str(work_dir / "spool" / str(port)),
            "TIDE_SCRATCH_DIR": str(work_dir / "scratch" / str(port)),
        },
    )


def _fail_leftover_runs(airflow: _Airflow, demo_started: datetime, say: Any) -> None:
    """Runs an earlier demo left queued or running would hold the pool: fail them."""
    for run in airflow.runs():
        leftover = datetime.fromisoformat(run["run_after"]) < demo_started
        if run["state"] in ("queued", "running") and leftover:
            say(f"failing {run['dag_run_id']}, left running by an earlier demo")
            airflow.fail(run["dag_run_id"])


def _write_summary(
    summary: dict[str, Any], settings: DemoSettings, out_json: Path, out_png: Path
) -> None:
    """The JSON summary and the PNG timeline of acceptance length and promotions."""
    from tide_lib.evaluation.plot import plot_timeline  # noqa: PLC0415

    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(summary, indent=2) + "\n")
    promotions = [(p["minutes"], p["version"].rsplit("-", 1)[-1]) for p in summary["promotions"]]
    plot_timeline(
        summary["rows"],
        promotions,
        out_png,
        k=settings.num_steps,
        title=f"TIDE demo: Korean traffic on an English draft ({settings.preset} target)",
    )


_COLUMNS = (("min", 5), ("cycle", 5), ("airflow", 34), ("tokens", 7), ("serving", 8))
_HEADER = " ".join(f"{name:>{width}}" for name, width in _COLUMNS) + "  AL serving  AL static"


class _Driver:
    """Triggers cycles until ``settings.cycles`` have finished and prints the live table."""

    def __init__(
        self, settings: DemoSettings, airflow: _Airflow, meter: _Meter, registry: Any
    ) -> None:
        self.settings = settings
        self.airflow = airflow
        self.meter = meter
        self.registry = registry
        self.rows: list[dict[str, Any]] = []
        self.promotions: list[dict[str, Any]] = []
        self.cycles: list[dict[str, Any]] = []
        self.mine: set[str] = set()

    def _finished_cycles(self, runs: dict[str, dict[str, Any]]) -> None:
        recorded = {cycle["run_id"] for cycle in self.cycles}
        for run_id in sorted(self.mine - recorded):
            run = runs.get(run_id)
            if run and run["state"] in ("success", "failed"):
                self.cycles.append(_cycle_record(self.registry, run))

    def _airflow_step(self, conf: dict[str, Any]) -> tuple[str, bool]:
        """Trigger the next cycle when none is active; ``(what Airflow is doing, active)``."""
        runs = {run["dag_run_id"]: run for run in self.airflow.runs()}
        self._finished_cycles(runs)
        active = [run for run in runs.values() if run["state"] in ("queued", "running")]
        if len(self.mine) >= self.settings.cycles:  # a late scheduled run is not one of ours
            active = [run for run in active if run["dag_run_id"] in self.mine]
        active.sort(key=lambda run: run["state"] != "running")
        if active:
            self.mine.add(active[0]["dag_run_id"])
            return self.airflow.current_task(active[0]["dag_run_id"]), True
        if len(self.cycles) < self.settings.cycles:
            self.mine.add(self.airflow.trigger(conf))
            return "triggered a cycle", True
        return "done", False

    def run(
        self, servers: list[str], conf: dict[str, Any], traffic_started: float, say: Any
    ) -> dict[str, Any]:
        say(_HEADER)
        say("-" * len(_HEADER))
        serving = _weight_version(servers[0])
        rows_after_last_cycle = 2  # measure the last draft before stopping
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.settings.refresh_s)
            minutes = (time.monotonic() - traffic_started) / 60
            try:
                state, active = self._airflow_step(conf)
            except httpx.HTTPError as error:  # e.g. SQLite busy: try again next row
                logger.warning("Airflow API call failed: %s", error)
                state, active = f"Airflow API: {type(error).__name__}", True
            try:
                now_serving = _weight_version(servers[0])
            except httpx.HTTPError as error:
                logger.warning("engine %s did not answer: %s", servers[0], error)
                now_serving = serving
            if now_serving != serving:
                self.promotions.append({"minutes": round(minutes, 2), "version": now_serving})
                serving = now_serving
            figures: dict[str, Any] | None = None
            tokens: int | str = "?"
            try:  # a hiccup of the lake's store: this row says "?", the next one measures
                figures = self.meter.measure()
                tokens = self.meter.tokens()
            except ConnectionError as error:
                logger.warning("reading the lake failed: %s", error)
            row: dict[str, Any] = {
                "minutes": round(minutes, 2),
                "cycle": len(self.cycles),
                "tokens": tokens,
                "serving_version": serving,
            }
            al = f"{'-':>10} {'-':>10}"
            if figures is not None:
                row |= figures
                self.rows.append(row)
                al = f"{figures['serving']:>10.2f} {figures['static']:>10.2f}"
            short = "v" + serving.rsplit("-v", 1)[-1]
            cells = (f"{minutes:.1f}", len(self.cycles), state[:34], row["tokens"], short)
            line = " ".join(
                f"{cell:>{width}}" for cell, (_, width) in zip(cells, _COLUMNS, strict=True)
            )
            say(f"{line}  {al}")
            if len(self.cycles) >= self.settings.cycles and not active:
                rows_after_last_cycle -= 1
                if rows_after_last_cycle <= 0:
                    break
        else:
            say(f"stopped after {self.settings.timeout_s:.0f} s, {len(self.cycles)} cycles done")
        return {
            "rows": self.rows,
            "promotions": self.promotions,
            "cycles": self.cycles,
            "final": _final(self.rows, serving),
        }


def _weight_version(server: str) -> str:
    version: str = httpx.get(f"{server}/get_weight_version", timeout=10).json()["weight_version"]
    return version


def _final(rows: list[dict[str, Any]], serving: str) -> dict[str, Any]:
    """Acceptance length of the last draft on the requests it alone served, and of static."""
    last = [row for row in rows if row["versions"] == [serving]]
    requests = sum(row["requests"] for row in last)
    final: dict[str, Any] = {"serving_version": serving, "requests": requests}
    if requests:
        serving_al = sum(row["serving"] * row["requests"] for row in last) / requests
        static_al = sum(row["static"] * row["requests"] for row in last) / requests
        final |= {
            "accept_length_serving": serving_al,
            "accept_length_static": static_al,
            "ratio_serving_static": serving_al / static_al,
        }
    return final


def _cycle_record(registry: Any, run: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"run_id": run["dag_run_id"], "state": run["state"]}
    version = registry.find_by_tag(Tags.CYCLE_ID, run["dag_run_id"])
    if version is not None:
        record |= {
            "version": version.version,
            "decision": version.tags.get(Tags.DECISION),
            "reason": version.tags.get(Tags.REASON),
            "promoted": version.tags.get(Tags.PROMOTED) == "true",
        }
    return record

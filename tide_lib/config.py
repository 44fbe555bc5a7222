"""TIDE's one typed configuration.

Every stage reads its settings from :class:`TideConfig`. Values come from the
environment (``TIDE_<SECTION>__<FIELD>``, e.g. ``TIDE_STORE__ENDPOINT``) or from
a YAML/JSON file named by ``TIDE_CONFIG`` (the environment wins); unknown keys
are rejected so that a typo fails loudly at the edge instead of silently falling back to a default.
The defaults describe the local stack (``tide stack up``) on 127.0.0.1.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CycleConfig",
    "FleetConfig",
    "GateConfig",
    "LakeConfig",
    "MLflowConfig",
    "ObjectStoreConfig",
    "ServeConfig",
    "StackConfig",
    "TideConfig",
    "TrainConfig",
    "load_config",
    "load_secret_files",
    "secrets_dir",
]

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from tide_lib.errors import TideError

DEFAULT_HOME = Path(".tide")
SECRETS_DIR_VARIABLE = "TIDE_SECRETS_DIR"
# Only TIDE's variables and the clients' credentials: a secrets dir must not be able to
# set PATH, LD_PRELOAD or PYTHONPATH for every process started from here.
_VARIABLE_NAME = re.compile(r"(TIDE_|MLFLOW_TRACKING_|AWS_)[A-Z0-9_]+")


def secrets_dir() -> Path:
    """Where secret files live: ``$TIDE_SECRETS_DIR``, else ``.tide/secrets``."""
    return Path(os.environ.get(SECRETS_DIR_VARIABLE) or DEFAULT_HOME / "secrets")


def load_secret_files(directory: Path | None = None) -> list[str]:
    """Export each file of the secrets dir as the variable it is named after.

    One file per variable (``TIDE_STORE__SECRET_KEY``, ``MLFLOW_TRACKING_PASSWORD``, ...),
    as a Kubernetes secret mounted as a volume or ``tide stack up`` leaves them; the
    environment wins over a file. MLflow's client reads its credentials from the
    environment, so files cannot be read into :class:`TideConfig` alone. Returns the
    names exported (never the values).
    """
    folder = directory or secrets_dir()
    if not folder.is_dir():
        return []
    exported = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and _VARIABLE_NAME.fullmatch(path.name) and path.name not in os.environ:
            os.environ[path.name] = path.read_text().strip()
            exported.append(path.name)
    return exported


def _descriptions_on_one_line(model: type[BaseModel]) -> None:
    """Join each field's description (its attribute docstring) into one line, schema too."""
    for field in model.model_fields.values():
        if field.description:
            field.description = " ".join(field.description.split())
    model.model_rebuild(force=True, raise_errors=False)  # a forward reference waits


class StrictModel(BaseModel):
    """Base for configuration sections: unknown keys are errors, values are immutable.

    A field's docstring is its description (``--help``, the trigger form, the JSON
    schema), joined into one line.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _descriptions_on_one_line(cls)


class ObjectStoreConfig(StrictModel):
    """Where captured hidden states and MLflow artifacts live (MinIO, SeaweedFS, S3)."""

    endpoint: str = "http://127.0.0.1:8333"
    """S3 endpoint URL (scheme decides TLS)"""
    access_key: str = "tide"
    """S3 access key id (local stack default)"""
    secret_key: SecretStr | None = None
    """S3 secret key, from TIDE_STORE__SECRET_KEY or a file of that name in TIDE_SECRETS_DIR only
    (`tide stack up` generates one for the local stack)"""
    session_token: SecretStr | None = None
    """session token of temporary credentials (an assumed role), from TIDE_STORE__SESSION_TOKEN or
    the Airflow connection; empty for static keys"""
    region: str = "us-east-1"
    ca_bundle: Path | None = None
    """PEM file of the CAs that sign an https endpoint; empty: the system's"""
    airflow_conn_id: str = "tide_store"
    """Airflow connection (type aws) that sets the endpoint, keys or role, region and CA bundle
    inside DAG tasks where it exists; empty: TIDE_STORE__* only"""
    lake_bucket: str = "tide-lake"
    """bucket of the hidden-state lake"""
    artifact_bucket: str = "tide-mlflow"
    """bucket of MLflow artifacts"""
    timeout_s: float = Field(5.0, gt=0)
    """connect/read timeout of one S3 call"""

    @field_validator("session_token", "ca_bundle", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        """An empty value (a connection exported "none" for it) means none."""
        return None if value == "" else value

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_url(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in {"http", "https"} or not parsed.hostname:
            raise ValueError(
                f"store endpoint must look like http://host:port or https://host, got {value!r}"
            )
        return value.rstrip("/")

    @property
    def host_port(self) -> str:
        parsed = urlparse(self.endpoint)
        return parsed.netloc

    def secret(self) -> str:
        """The secret key; a clear error where none is configured (there is no default)."""
        if self.secret_key is None:
            raise ValueError(
                "no S3 secret key is configured: set TIDE_STORE__SECRET_KEY, or put it in a "
                f"file named TIDE_STORE__SECRET_KEY in {secrets_dir()} (TIDE_SECRETS_DIR); "
                "`tide stack up` writes one there for the local stack"
            )
        return self.secret_key.get_secret_value()

    @property
    def secure(self) -> bool:
        return urlparse(self.endpoint).scheme == "https"


class MLflowConfig(StrictModel):
    """The MLflow tracking server TIDE registers drafts in."""

    tracking_uri: str = "http://127.0.0.1:5000"
    airflow_conn_id: str = "tide_mlflow"
    """Airflow connection (type http) that sets the tracking URI and login inside DAG tasks where it
    exists; empty: TIDE_MLFLOW__TRACKING_URI and MLFLOW_TRACKING_* only"""
    backend_store_uri: str | None = None
    """backend of the local MLflow server; default: SQLite in the stack state dir"""


class StackConfig(StrictModel):
    """Ports and state of the local stack started by ``tide stack up``."""

    state_dir: Path = DEFAULT_HOME / "stack"
    host: str = "127.0.0.1"
    s3_port: int = Field(8333, ge=1, le=55535)
    master_port: int = Field(9333, ge=1, le=55535)
    volume_port: int = Field(9340, ge=1, le=55535)
    filer_port: int = Field(8888, ge=1, le=55535)
    admin_port: int = Field(23646, ge=1, le=55535)
    mlflow_port: int = Field(5000, ge=1, le=65535)
    airflow_port: int = Field(8080, ge=1, le=65535)
    airflow: bool = True
    """also run Airflow (api-server, scheduler, ...)"""
    executor: Literal["LocalExecutor", "CeleryExecutor"] = "LocalExecutor"
    """CeleryExecutor also starts one Celery worker per queue (default, mi250)"""
    airflow_database_url: str | None = None
    """Airflow metadata DB as a SQLAlchemy URL (default: SQLite in the state dir); CeleryExecutor
    needs PostgreSQL, e.g. postgresql+psycopg2://postgres@127.0.0.1/airflow"""
    celery_broker_url: str = "redis://127.0.0.1:6379/0"
    """Celery broker (Redis or RabbitMQ)"""
    worker_log_port: int = Field(8793, ge=1, le=65534)
    """log server of the first Celery worker (next: +1)"""
    start_timeout_s: float = Field(90.0, gt=0)
    auth: bool = True
    """logins everywhere: Airflow's simple auth manager with passwords (users admin and viewer),
    MLflow's basic-auth app. Off only for the demo (all-admins Airflow, open MLflow on loopback)"""
    airflow_admin_password: SecretStr | None = None
    """password of the Airflow user `admin` (Admin role); from TIDE_STACK__AIRFLOW_ADMIN_PASSWORD or
    its file in TIDE_SECRETS_DIR, generated there by `tide stack up` when unset"""
    airflow_viewer_password: SecretStr | None = None
    """password of the Airflow user `viewer` (Viewer role); like the admin's"""
    services: list[str] = Field(default_factory=list)
    """the services this host runs (names as `tide stack status` shows them); empty: every enabled
    one. Several hosts split one stack this way"""
    airflow_api_url: str | None = None
    """where other hosts reach the Airflow API server (workers call its execution API); default
    http://<host>:<airflow_port>"""

    @model_validator(mode="after")
    def _celery_needs_a_server_database(self) -> StackConfig:
        url = self.airflow_database_url or ""
        if self.executor == "CeleryExecutor" and not url.startswith("postgresql"):
            raise ValueError(
                "CeleryExecutor needs a PostgreSQL metadata DB: set stack.airflow_database_url "
                "(TIDE_STACK__AIRFLOW_DATABASE_URL), e.g. "
                "postgresql+psycopg2://postgres@127.0.0.1:5432/airflow"
            )
        return self


class LakeConfig(StrictModel):
    """How the capture writer batches, uploads and spools shards."""

    prefix: str = "hidden_states"
    shard_max_bytes: int = Field(32 * 2**20, gt=0)
    """flush a shard at this raw size"""
    shard_max_age_s: float = Field(30.0, gt=0)
    """flush a shard at this age"""
    queue_max_records: int = Field(256, gt=0)
    """records waiting before drops"""
    memory_max_bytes: int = Field(1 * 2**30, gt=0)
    """raw tensor bytes queued or buffered before drops"""
    spool_dir: Path = DEFAULT_HOME / "spool"
    spool_max_bytes: int = Field(4 * 2**30, gt=0)
    """local disk kept for outages"""
    retry_interval_s: float = Field(1.0, gt=0)
    """wait between upload retries"""
    commit_settle_s: float = Field(120.0, ge=0)
    """a commit is taken past a watermark only once this old: with several writers a marker stamped
    earlier can land later, and a watermark must not jump over it. Cover the slowest marker PUT (3
    tries of store.timeout_s x 7: 105 s at the default 5 s) plus clock skew between capture hosts;
    writers log a marker that lands later than this. 0: off, for one writer flushed before each read
    """
    retention_days: float = Field(30.0, gt=0)
    """shards older than this are deleted once consumed"""
    max_clock_skew_s: float = Field(900.0, ge=0)
    """a marker that lands later than its stamp (+ commit_settle_s) counts from when it landed (the
    store's Last-Modified), so a capture host whose clock is behind loses no data; readers look this
    far behind the watermark for such markers. Listing cost grows with the commits of this span,
    never with the lake's age. 0 trusts the stamps (TIDE's writers stamp by the store's clock when
    theirs is off; a benchmark's synthetic history needs it)"""
    tensor_compression: Literal["zstd", "lz4", "snappy", "none"] = "zstd"
    """Parquet codec of the hidden-state columns: float16 states shrink ~8% with zstd; lz4 encodes
    ~6x faster for a CPU-starved serving host. Other columns use zstd."""


class TrainConfig(StrictModel):
    """EAGLE3 draft training (SpecForge's model and objective) on one lake window."""

    device: str = "cpu"
    """cpu, cuda, cuda:N; multi-GPU runs under torchrun"""
    steps: int = Field(120, ge=0)
    """optimizer steps (a fresh draft's; a warm start scales them to its window)"""
    batch_size: int = Field(4, gt=0)
    """samples per optimizer step (per process)"""
    learning_rate: float = Field(1e-3, gt=0)
    """AdamW's peak rate (warm starts scale it by warm_lr_scale)"""
    warmup_steps: int = Field(10, ge=0)
    """linear warmup before the cosine decay"""
    max_grad_norm: float = Field(0.5, gt=0)
    """gradients are clipped to this norm"""
    ttt_length: int = Field(4, gt=0)
    """training-time-test unroll (SpecForge's default is 7; 4 is the recipe every benchmark and
    the adaptation suite measured)"""
    ploss_decay: float = Field(0.8, gt=0, le=1)
    """weight decay of later TTT positions"""
    max_len: int = Field(512, gt=1)
    """tokens kept per sample"""
    draft_vocab_size: int = Field(2048, gt=0)
    """tokens the draft can propose (d2t/t2d map them to the target's)"""
    vocab_mapping: Literal["mix", "parent"] = "mix"
    """warm starts rebuild d2t/t2d from the token frequencies of the training mix (window and
    replay, weighted by how often each sample is drawn), keeping the parent's lm_head rows of tokens
    that stay; parent: keep the parent's mapping"""
    warm_lr_scale: float = Field(0.5, gt=0, le=1)
    """warm starts fine-tune at learning_rate x this: a fitted draft's first steps under a fresh
    AdamW at the full rate knock it back (a Korean cycle's held-out figure fell 2.65 -> 2.22 in 20
    steps, and older traffic with it)"""
    warm_epochs: float = Field(10.0, ge=0)
    """warm starts train this many passes over the training samples (steps clamped to
    warm_min_steps..warm_max_steps, batch to the sample count); 0: use steps as given"""
    warm_min_steps: int = Field(10, ge=0)
    """fewest steps of a warm start (see warm_epochs)"""
    warm_max_steps: int = Field(200, ge=1)
    """most steps of a warm start (see warm_epochs)"""
    validation_fraction: float = Field(0.15, ge=0, lt=1)
    """share of samples (by a hash of their tokens, window and replay alike) held out, never trained
    on, to score offline acceptance during training, besides the window's held-out requests the
    cycle exports (held_out/); the best checkpoint, the parent included, is exported. 0: no
    validation, the last step is exported"""
    validation_max_samples: int = Field(32, ge=1)
    """cap on held-out distinct requests scored, held_out/ ones included"""
    min_gain_requests: int = Field(6, ge=0)
    """held-out requests a warm start's gain beyond the noise must rest on to replace its parent
    (warm_gain: beyond_noise); with fewer the spread that sets the noise is itself noise, and the
    parent is kept (its best step left to continue from)"""
    export: Literal["best", "last"] = "best"
    """which draft a run exports: 'best' on held-out traffic (a run whose best was the parent
    registers nothing), or the 'last' step (what cycle.force_promote uses)"""
    eval_every: int = Field(20, gt=0)
    """steps between held-out evaluations"""
    warm_gain: Literal["beyond_noise", "any"] = "beyond_noise"
    """what a warm start's checkpoint must gain over its parent on held-out traffic to replace it:
    beyond_noise, a paired gain beyond the noise of its held-out requests; any, a higher figure (a
    cycle uses it when its champion's drift check named segments it no longer fits, or still learns,
    unless the champion was never judged, a seeded one's first check; the gate still judges the
    draft)"""
    k: int = Field(4, ge=1)
    """draft tokens per verify of the held-out replay"""
    forgetting_tolerance: float = Field(0.1, ge=0)
    """a step whose held-out acceptance on any group (replayed older traffic, a segment) fell more
    than this below the parent's is never kept (as gate.tolerance)"""
    forgetting_min_tokens: int = Field(64, ge=0)
    """held-out output tokens a group needs for the forgetting check to judge it alone; groups of
    traffic to keep with fewer are judged together once together they have this many (as
    gate.min_segment_tokens)"""
    distill_weight: float = Field(1.0, ge=0)
    """warm starts: weight of the KL(parent || student) term on replay samples, which keeps the
    draft's distribution on older traffic close to the champion's"""
    checkpoint_every: int = Field(50, gt=0)
    """steps between checkpoints a retried run resumes from"""
    keep_checkpoints: int = Field(2, gt=0)
    """checkpoints kept, the newest"""
    log_every: int = Field(10, gt=0)
    """steps between logged loss and accuracy"""
    seed: int = 0
    """the draft's initialisation and the order samples are drawn in"""
    features: Literal["captured", "recompute"] = "captured"
    """captured: train on the hidden states serving stored (reuse); recompute: re-run the target on
    the token ids every step (the baseline TIDE's reuse avoids)"""
    loss_backend: Literal["auto", "triton", "torch"] = "auto"
    """auto: SpecForge's Triton kernel on CUDA, its torch reference on CPU"""
    nproc_per_node: int = Field(1, ge=1, le=64)
    """training processes on the trainer host, one per accelerator (an MI250 node has 8 GCDs); above
    1 the cycle's train step runs under torchrun (gloo on CPU)"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 autocast where the device supports it, else fp32"""
    max_skipped_step_fraction: float = Field(0.1, ge=0, le=1)
    """steps whose loss or gradients are not finite are skipped (no optimizer step); training fails
    once more than this share of all steps was skipped"""


MIN_CALIBRATION_TOKENS = 8  # a cost probe shorter than this may time no draft step


class ServeConfig(StrictModel):
    """The reference engine (``tide serve``); option names follow SGLang's server arguments."""

    model_path: Path | None = None
    """HF target model directory"""
    speculative_draft_model_path: str | None = None
    """EAGLE3 draft directory or s3://bucket/prefix; none: plain decoding"""
    speculative_algorithm: Literal["EAGLE3"] = "EAGLE3"
    speculative_num_steps: int = Field(4, ge=1, le=16)
    """draft tokens per verify (k)"""
    speculative_eagle_topk: int = Field(1, ge=1, le=1)
    """1: chain drafting"""
    speculative_num_draft_tokens: int | None = None
    """must be num_steps + 1 for chain drafting (default)"""
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    api_key: SecretStr | None = None
    """SGLang's --api-key: bearer key of every route but /health and /metrics. The engine requires
    it and the fleet client sends it; from TIDE_SERVE__API_KEY only"""
    admin_api_key: SecretStr | None = None
    """SGLang's --admin-api-key: bearer key of admin routes (/update_weights_from_disk); from
    TIDE_SERVE__ADMIN_API_KEY only"""
    admin_key_required: bool = True
    """admin routes (/update_weights_from_disk) need the admin key and answer 403 on a server
    without one (SGLang's ADMIN_FORCE); false: SGLang's default for the route
    (ADMIN_OPTIONAL: open when no key is set)"""
    served_model_name: str | None = None
    """target id in captures (default: dir name)"""
    max_prompt_tokens: int = Field(1024, gt=0)
    max_new_tokens_limit: int = Field(1024, gt=0)
    weight_version: str = "initial"
    """version of the draft served at start"""
    disable_speculation: bool = False
    """serve with plain decoding"""
    speculative_adaptive: bool = False
    """SGLang's --speculative-adaptive: serve each request at the k in 0..speculative_num_steps (0:
    plain decoding) with the most expected tokens/s, from the draft and verify costs and the
    acceptance measured while serving (per segment label); off: always speculative_num_steps, the k
    that pays is still measured and reported in /server_info"""
    speculative_adaptive_explore_every: int = Field(16, ge=2)
    """adaptive k: every Nth request runs at a k next to the chosen one"""
    speculative_adaptive_probe_rounds: int = Field(8, ge=0)
    """adaptive k: verify rounds an exploration at another k than the model's speculates while plain
    decoding is served; the rest of the request is decoded plainly (it measures acceptance and
    costs, not what its k delivers); 0: it speculates the whole request"""
    speculative_adaptive_calibration_tokens: int = Field(24, ge=0, le=256)
    """adaptive k: output tokens of each probe generation (one per k, on a fixed prompt) that
    measure the draft and verify costs before serving; 0: the first requests measure them"""
    decode_threads: int = Field(1, ge=0, le=256)
    """intra-op CPU threads of the decoding worker (torch.set_num_threads in its thread; calibration
    runs there too); 0: left as the process has it. Batch-one decoding is many small operations, and
    a team of OpenMP threads in a thread other than the main one cost more than it gave: on 2 cores,
    k=4 served 77-86 tokens/s with 2 threads against 150-171 with 1. Threads the process starts
    later inherit it (torch keeps one default)"""
    speculative_adaptive_min_gain: float = Field(0.02, ge=0, le=1)
    """adaptive k: speculate only when it beats plain decoding by this share"""
    capture: bool = True
    """capture hidden states of finished requests"""
    capture_sample_rate: float = Field(1.0, ge=0, le=1)
    """share of requests captured"""
    capture_max_held_bytes: int = Field(2 * 2**30, gt=0)
    """host memory the SGLang plugin's open requests may hold; a request that would exceed it is
    dropped from capture and counted, never served worse"""
    capture_skip_accept_rate: float | None = Field(None, ge=0, le=1)
    """skip requests whose draft acceptance rate is at least this"""
    draft_sources: list[str] = Field(default_factory=list)
    """where /update_weights_from_disk may load drafts from: local root directories and
    s3://bucket/prefix prefixes (JSON list in TIDE_SERVE__DRAFT_SOURCES). Always allowed besides:
    the directory holding the startup draft and models:/, runs:/, mlflow-artifacts:/ URIs of the
    configured MLflow server"""
    draft_cache_versions: int = Field(2, ge=1)
    """downloaded drafts kept on disk, one per weight version (newest)"""
    max_request_bytes: int = Field(1 << 20, gt=0)
    """largest request body accepted; larger ones get 413"""
    max_queued_requests: int = Field(64, gt=0)
    """requests waiting for the worker; more get 503 with Retry-After"""

    @field_validator("api_key", "admin_api_key", mode="before")
    @classmethod
    def _empty_key_is_no_key(cls, value: Any) -> Any:
        # An empty variable would otherwise be a key that "Bearer " matches.
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        return None if raw is None or not str(raw).strip() else value

    @field_validator("speculative_adaptive_calibration_tokens")
    @classmethod
    def _probes_measure_every_count(cls, value: int) -> int:
        if 0 < value < MIN_CALIBRATION_TOKENS:
            raise ValueError(
                f"adaptive k's cost probes need at least {MIN_CALIBRATION_TOKENS} output "
                "tokens each to measure a draft step and every verify size; set "
                f"TIDE_SERVE__SPECULATIVE_ADAPTIVE_CALIBRATION_TOKENS to 0 (off) or >= "
                f"{MIN_CALIBRATION_TOKENS}"
            )
        return value


class FleetConfig(StrictModel):
    """How promotion and rollback reach the serving fleet (keys: ``serve.*api_key``)."""

    rollout: Literal["hot_swap", "restart"] = "hot_swap"
    """hot_swap: /update_weights_from_disk (SGLang needs TIDE's plugin); restart:
    fleet.restart_command relaunches one server at a time with the new draft"""
    restart_command: str | None = None
    """launcher that relaunches one server with a new draft, run without a shell; placeholders {url}
    {host} {port} {draft} {weight_version} {num_steps} (k)"""
    restart_timeout_s: float = Field(1800.0, gt=0)
    """a relaunched server must serve the new draft within this"""

    @model_validator(mode="after")
    def _restart_needs_a_command(self) -> FleetConfig:
        if self.rollout == "restart" and not self.restart_command:
            raise ValueError(
                "fleet.rollout is restart but fleet.restart_command is unset: set "
                "TIDE_FLEET__RESTART_COMMAND to the launcher (e.g. a kubectl rollout command)"
            )
        return self


class GateConfig(StrictModel):
    """When a challenger draft replaces the champion (acceptance length, SGLang's count)."""

    recent_segment: str | None = None
    """deprecated, no effect: segments are the traffic's own (client labels or clusters of the
    target's states), weighted by their share of the window"""
    margin: float = Field(0.05, ge=0)
    """required gain of the window-share-weighted acceptance length"""
    tolerance: float = Field(0.10, ge=0)
    """allowed loss on each protected segment (acceptance length)"""
    min_segment_share: float = Field(0.10, ge=0, le=1)
    """a segment is protected by the tolerance when its token share of the window, or of the older
    traffic in the lookback, reaches this; clusters below it merge into their nearest larger cluster
    """
    min_segment_tokens: int = Field(64, ge=0)
    """held-out output tokens a segment needs before the tolerance protects it alone: a figure from
    fewer is too noisy to block a promotion (it still counts in the weighted gain); traffic to keep
    with fewer (older traffic, and segments the champion serves better than the window as a whole)
    is protected together once together it has this many"""
    floor: bool = True
    """also judge the challenger against the registry's 'baseline' draft (the first champion; move
    the alias in the MLflow UI to re-anchor): a protected segment may not end more than the
    tolerance below it while falling below the champion, so losses each within the tolerance cannot
    add up over promotions"""
    net_gain: bool = True
    """also reject a challenger whose loss on the traffic to keep, judged together, exceeds both the
    tolerance and its window-weighted gain (point estimates): a loss the margin of error cannot tell
    from chance is still no trade for a smaller gain"""
    k: int = Field(4, ge=1)
    """draft tokens per verify the gate judges at"""
    ks: list[int] = Field(default_factory=lambda: [3, 5])
    """k values evaluated"""

    @field_validator("recent_segment")
    @classmethod
    def _recent_segment_deprecated(cls, value: str | None) -> str | None:
        if value is not None:
            warnings.warn(
                "gate.recent_segment is deprecated and has no effect: the gate now judges "
                "the traffic's own segments (client labels, else clusters of the target's "
                "states), weighted by their share of the window's tokens; remove it from "
                "your configuration",
                DeprecationWarning,
                stacklevel=2,
            )
            logging.getLogger(__name__).warning(
                "gate.recent_segment=%r is deprecated and ignored; remove it", value
            )
        return value


class CycleConfig(StrictModel):
    """One adaptation cycle of ``tide_adaptation`` (Airflow ``Param``s mirror these fields)."""

    target_id: str = "demo"
    """target served by the fleet (its lake slug)"""
    target_path: Path = DEFAULT_HOME / "targets" / "demo"
    """HF target directory"""
    min_new_tokens: int = Field(2000, ge=1)
    """new captured tokens that start a cycle"""
    replay_share: float = Field(0.5, ge=0, le=4)
    """older-traffic tokens mixed in, as a share of the window"""
    replay_min_segment_share: float = Field(0.0, ge=0, le=1)
    """each older segment the gate protects for its older traffic alone (gate.min_segment_share of
    it, less of the window's) gets at least this share of the replay budget, whatever its volume:
    traffic of short requests is replayed enough to be kept (0, the default: by volume alone)"""
    held_out_percent: int = Field(20, ge=1, le=50)
    """window requests kept for evaluation"""
    replay_lookback_hours: float = Field(72.0, gt=0)
    """replay and older held-out traffic are drawn from commits this far behind the watermark: a
    cycle lists and reads a bounded slice, never the whole lake"""
    held_out_older_tokens: int = Field(4096, ge=0)
    """tokens of older held-out traffic the gate judges forgetting on; past them, up to twice as
    many, requests of segments with fewer than gate.min_segment_tokens held-out output tokens, so
    that short requests can be protected alone"""
    held_out_reserve_percent: int = Field(20, ge=0, le=50)
    """a band of older requests past held_out_percent (by the same content hash) that a segment
    still short of gate.min_segment_tokens held-out output tokens is judged on too, instead of
    replayed or learned again this cycle, until it has that many: the gate and the trainer's steps
    see a thin segment forget. They may have been learned when they arrived, by the champion too, so
    a drop on them is forgetting, measured if anything in the champion's favour (0: off)"""
    segment_labels_max: int = Field(16, ge=0, le=256)
    """most client labels (custom_labels.segment) kept as segments of their own, the most tokens
    first; requests of further labels are clustered as if unlabelled"""
    segment_clusters: int = Field(4, ge=1, le=64)
    """most clusters of the target's states that segment unlabelled traffic (k-means, refit each
    cycle from the previous cycle's centroids)"""
    skip_without_drift: bool = True
    """measure the champion on the window first and train only where a segment has headroom (served
    more than drift_tolerance below what a draft reaches on it); else record 'no headroom' and move
    on"""
    continue_training: bool = True
    """a cycle whose training kept its champion (no step beat it beyond the noise of the held-out
    requests) leaves its best step that rose above it, forgetting nothing, in the lake; the next
    cycle on the same champion starts training there (the champion stays the draft to beat); off:
    every cycle starts from the champion"""
    drift_tolerance: float = Field(0.15, ge=0)
    """headroom that counts: acceptance length a segment is served below its estimate (beyond the
    margin of error); a cycle that gains this or less on a segment settles it at what the champion
    serves there"""
    relearn_older: bool = True
    """a cycle the headroom check sends to learn a segment also learns that segment's earlier
    requests among the older traffic it reads (never held-out ones), not the window's alone;
    segments learned only because the window held too little to judge keep theirs as replay; off:
    older traffic is only replayed
    (kept, not learned)"""
    drift_sample_tokens: int = Field(20000, ge=1)
    """window tokens the champion is measured on (an even sample)"""
    consolidate: bool = True
    """warm starts never stack up: a cycle that would train again on a champion a warm start
    promoted (its check found headroom) consolidates instead. A consolidation
    learns the window and every segment's older traffic in the lookback together, nothing held by
    distillation, as one draft trained on it all at once would be (consolidate_from); the gate
    judges it like any challenger, and a consolidated champion is warm-started again, as is a
    champion whose consolidation replaced nothing (once per champion). Off: only warm starts"""
    consolidate_each_drift: bool = True
    """with consolidate: every cycle the headroom check sends to train a champion a cycle's gate
    promoted consolidates, a consolidated one's too (never a seeded one: nothing shifted yet), not
    only one a warm start promoted (once per champion still: one whose consolidation replaced
    nothing is warm-started). Off, a warm start from a consolidated champion may lose a segment of
    short answers, too thin for the gate to protect alone (Korean law 0.85 of its acceptance length
    on Korean last; 1.27 with it on)"""
    consolidate_from: Literal["champion", "baseline"] = "champion"
    """where a consolidation starts: the champion, at the warm-start recipe (training.warm_epochs
    passes); or the registry's baseline draft, the gate's floor, at the full learning rate for
    consolidate_epochs passes (as a draft trained on all of it at once would be), so that the losses
    of the warm starts before it are not carried on (the champion stays the draft to beat). From the
    baseline, a consolidation must regain what the champion reached and, on Korean last, learned the
    new segment less (0.78 of an oracle against 0.89 from the champion)"""
    consolidate_epochs: float = Field(20.0, gt=0)
    """passes over the traffic a consolidation from the baseline learns (steps clamped to
    training.steps..consolidate_max_steps)"""
    consolidate_max_steps: int = Field(800, ge=1)
    """a consolidation's cap on optimizer steps (from the champion or the baseline)"""
    servers: list[str] = Field(default_factory=list)
    """fleet base URLs"""
    schedule_minutes: int = Field(60, ge=0)
    """how often the scheduler starts a cycle (its sensor then waits for new tokens); 0: only
    triggered cycles. Read when the DAG is parsed, not per run"""
    force_promote: bool = False
    """train every cycle (no drift check) and promote the last trained step even if it never beat
    its parent on held-out traffic and the gate rejects it (demos and tests of the promotion path)
    """
    dry_run: bool = False
    """train, register and evaluate, but do not promote"""


class TideConfig(BaseSettings):
    """All of TIDE's settings; sections mirror the stages of the loop."""

    model_config = SettingsConfigDict(
        env_prefix="TIDE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    scratch_dir: Path = DEFAULT_HOME / "scratch"
    """this host's scratch space: each task works in a directory of its own under it, removed when
    the task ends; nothing in it is handed to another task"""
    store: ObjectStoreConfig = ObjectStoreConfig()
    mlflow: MLflowConfig = MLflowConfig()
    stack: StackConfig = StackConfig()
    lake: LakeConfig = LakeConfig()
    training: TrainConfig = TrainConfig()
    serve: ServeConfig = ServeConfig()
    gate: GateConfig = GateConfig()
    cycle: CycleConfig = CycleConfig()
    fleet: FleetConfig = FleetConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        config_file = os.environ.get("TIDE_CONFIG")
        if config_file:
            path = Path(config_file)
            if not path.is_file():
                raise FileNotFoundError(
                    f"TIDE_CONFIG points at {path}, which does not exist; "
                    "unset it or write a YAML/JSON file there"
                )
            # JSON is valid YAML, so one source reads both.
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


_descriptions_on_one_line(TideConfig)


class ConfigError(TideError, ValueError):
    """The configuration is invalid: the message names each field and what is wrong with it,
    never the value given (a section's values may hold keys and passwords)."""


def load_config(**overrides: Any) -> TideConfig:
    """Build the configuration: ``overrides`` over the environment (secret files of
    ``$TIDE_SECRETS_DIR`` included, see :func:`load_secret_files`) over ``$TIDE_CONFIG``.

    Raises :class:`ConfigError` without the inputs: pydantic's own error would print a
    whole section, secrets included, when a section-level check fails.
    """
    load_secret_files()
    try:
        return TideConfig(**overrides)
    except ValidationError as error:
        problems = [
            f"  {'.'.join(str(part) for part in item['loc']) or 'config'}: {item['msg']}"
            for item in error.errors(include_input=False, include_url=False)
        ]
        raise ConfigError("invalid TIDE configuration:\n" + "\n".join(problems)) from None

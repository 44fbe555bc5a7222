"""``tide``: the command line of TIDE.

Each subcommand parses its arguments, loads the typed configuration once, and
calls one library function; errors that a user can fix are printed as one
readable line (exit code 2) instead of a traceback.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import dataclasses
import inspect
import json
import logging
import sys
from collections.abc import Callable
from datetime import datetime
from importlib.metadata import entry_points
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, Union, get_args, get_origin

from pydantic import ValidationError

from tide_lib.config import (
    ServeConfig,
    StrictModel,
    TideConfig,
    TrainConfig,
    load_config,
)
from tide_lib.errors import TideError

if TYPE_CHECKING:
    from tide_lib.stack import ServiceStatus

logger = logging.getLogger("tide")

Handler = Callable[[argparse.Namespace, TideConfig], int]
# What add_subparsers returns (argparse names its class privately).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
DEFAULT_TARGETS = Path(".tide/targets")
COMMAND_PLUGINS = "tide.commands"  # entry points: f(commands) adds a command group
_CONVERTERS: dict[object, Callable[[str], Any]] = {int: int, float: float, str: str, Path: Path}


def echo(text: str = "") -> None:
    """User-facing output of a command (tables, URLs); diagnostics go through logging."""
    sys.stdout.write(text + "\n")


# -- stack ------------------------------------------------------------------------------


def _stack_up(_args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.stack import StackManager  # noqa: PLC0415

    _print_status(StackManager(config).up())
    return 0


def _stack_down(_args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.stack import StackManager  # noqa: PLC0415

    StackManager(config).down()
    echo("stack stopped")
    return 0


def _stack_status(_args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.stack import StackManager  # noqa: PLC0415

    statuses = StackManager(config).status()
    _print_status(statuses)
    return 0 if all(status.healthy for status in statuses) else 1


def _print_status(statuses: list[ServiceStatus]) -> None:
    echo(f"{'service':<12}{'state':<10}{'pid':>8}  url / log")
    for status in statuses:
        state = "healthy" if status.healthy else ("starting" if status.running else "stopped")
        echo(f"{status.name:<12}{state:<10}{status.pid or '-':>8}  {status.url}  ({status.log})")


# -- lake -------------------------------------------------------------------------------


def _lake_stats(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415
    from tide_lib.lake.reader import partition_stats  # noqa: PLC0415

    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    slugs = [args.target] if args.target else reader.list_targets()
    rows = partition_stats(reader, slugs)
    if args.json:
        echo(json.dumps([dataclasses.asdict(row) for row in rows]))
        return 0
    if not rows:
        echo(f"no committed shards in s3://{config.store.lake_bucket}/{config.lake.prefix}/")
        return 0
    echo(f"{'target':<32}{'partition':<24}{'shards':>8}{'records':>9}{'tokens':>11}{'MB':>9}")
    for row in rows:
        echo(
            f"{row.target_slug:<32}{row.partition:<24}{row.shards:>8}{row.records:>9}"
            f"{row.tokens:>11}{row.size_bytes / 1e6:>9.1f}"
        )
    echo(
        f"{'total':<56}{sum(r.shards for r in rows):>8}{sum(r.records for r in rows):>9}"
        f"{sum(r.tokens for r in rows):>11}{sum(r.size_bytes for r in rows) / 1e6:>9.1f}"
    )
    return 0


# -- serving ---------------------------------------------------------------------------------


def _serve(args: argparse.Namespace, config: TideConfig) -> int:
    """Serves POST /generate, GET /health, /model_info, /server_info, /metrics, and POST
    /update_weights_from_disk with SGLang's field names. Chain drafting with
    --speculative-num-steps draft tokens per verify; captured hidden states go to the
    lake configured by TIDE_STORE__* / TIDE_LAKE__*.
    """
    from tide_lib.serving.server import run_server  # noqa: PLC0415

    run_server(config.model_copy(update={"serve": config_from_args(args, config.serve)}))
    return 0


def _fleet(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.serving.fleet import FleetError, FleetManager, RestartLauncher  # noqa: PLC0415

    rollout = config.fleet
    fleet = FleetManager(
        [url for url in args.servers.split(",") if url],
        api_key=config.serve.api_key,
        admin_api_key=config.serve.admin_api_key,
        launcher=RestartLauncher(rollout.restart_command, timeout_s=rollout.restart_timeout_s)
        if rollout.rollout == "restart" and rollout.restart_command
        else None,
    )
    if args.action == "tune-k":
        return _fleet_k(args, fleet)
    try:
        if args.action == "promote":
            states = fleet.promote(
                args.model_path,
                args.weight_version,
                probe_prompts=args.probe_prompt or (),
                min_accept_length=args.min_accept_length,
            )
        elif args.action == "rollback":
            states = fleet.promote(args.model_path, args.weight_version)
        else:
            states = fleet.status()
    except FleetError as error:
        logger.error("%s", error)
        return 1
    echo(f"{'server':<32}{'health':<9}{'version':<20}{'accept len':>11}  draft")
    for state in states:
        accept = f"{state.avg_accept_length:.2f}" if state.avg_accept_length is not None else "-"
        health = "ok" if state.healthy else "DOWN"
        echo(
            f"{state.url:<32}{health:<9}{state.weight_version or '-':<20}"
            f"{accept:>11}  {state.draft_path or state.error or '-'}"
        )
    return 0 if all(state.healthy for state in states) else 1


def _fleet_k(args: argparse.Namespace, fleet: Any) -> int:
    """``tide fleet tune-k``: the k each server should run with, applied on ``--apply``."""
    from tide_lib.serving.fleet import FleetError  # noqa: PLC0415

    choices = fleet.recommended_k(
        draft_cost_ratio=args.draft_cost_ratio,
        verify_token_cost_ratio=args.verify_token_cost_ratio,
        max_k=args.max_k,
    )
    echo(f"{'server':<32}{'k now':>6}{'accept len':>11}{'best k':>7}  tokens per plain step")
    for state in fleet.status():
        choice = choices.get(state.url)
        accept = f"{state.avg_accept_length:.2f}" if state.avg_accept_length is not None else "-"
        best = str(choice.k) if choice is not None else "-"
        rates = " ".join(f"{r:.2f}" for r in choice.tokens_per_s) if choice is not None else ""
        now = state.speculative_num_steps or "-"
        echo(f"{state.url:<32}{now:>6}{accept:>11}{best:>7}  {rates}")
    if not args.apply:
        return 0
    try:
        relaunched = fleet.apply_k(choices)
    except FleetError as error:
        logger.error("%s", error)
        return 1
    echo(f"relaunched with their best k: {', '.join(relaunched) or 'none'}")
    return 0


# -- evaluation --------------------------------------------------------------------------------


def _eval(args: argparse.Namespace, config: TideConfig) -> int:
    if args.action == "online":
        from tide_lib.evaluation.online import online_acceptance  # noqa: PLC0415

        prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
        online = online_acceptance(
            args.server,
            prompts,
            max_new_tokens=args.max_new_tokens,
            api_key=config.serve.api_key,
        )
        echo(json.dumps(dataclasses.asdict(online), indent=2))
        return 0
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415
    from tide_lib.training.specforge_runtime import prepare_specforge  # noqa: PLC0415

    prepare_specforge("cpu")
    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    since = datetime.fromisoformat(args.recent_since) if args.recent_since else None
    windows = {"recent": (since, None), **({"older": (None, since)} if since else {})}
    ks = args.k or config.gate.ks
    results = offline_acceptance(
        load_draft(args.draft, args.target),
        args.target,
        {
            name: reader.iter_records(
                reader.list_shards(args.lake_target, start=start, end=end), start=start, end=end
            )
            for name, (start, end) in windows.items()
        },
        ks,
    )
    table = {
        name: {
            f"k{k}": {"accept_length": c.accept_length, "requests": c.requests}
            for k, c in by_k.items()
        }
        for name, by_k in results.items()
    }
    echo(json.dumps(table, indent=2))
    return 0


# -- target and training ------------------------------------------------------------------


def _target_build(args: argparse.Namespace, _config: TideConfig) -> int:
    """Builds a small Llama-architecture target in HF format (config, safetensors,
    tokenizer) from English/Korean conversations and documentation shipped in installed
    packages. Reused when already built with the same preset and seed.
    """
    from tide_lib.target_model import build_target  # noqa: PLC0415

    out = args.out or DEFAULT_TARGETS / args.preset
    info = build_target(out, preset_name=args.preset, seed=args.seed, force=args.force)
    echo(json.dumps({"path": str(out), **{k: v for k, v in info.items() if k != "key"}}, indent=2))
    return 0


def _train(args: argparse.Namespace, config: TideConfig) -> int:
    """Trains SpecForge's LlamaForCausalLMEagle3 with its EAGLE3 objective on a window of
    captured target states, warm-started from --parent if given. Checkpoints go to
    OUT/checkpoints (a rerun resumes), the SGLang-loadable draft to OUT/draft.
    Multi-GPU: run under torchrun with --device cuda.
    """
    from tide_lib.training.trainer import train_draft  # noqa: PLC0415

    train_config = config_from_args(args, config.training)
    data_dir = args.data
    if data_dir is None:
        data_dir = args.out / "window"
        _export_lake_window(config, args.lake_target, args.after, data_dir)
    sink = None
    if args.mlflow_run_id:
        from tide_lib.training.tracking import MlflowMetricSink  # noqa: PLC0415

        sink = MlflowMetricSink(config.mlflow.tracking_uri, args.mlflow_run_id)
    result = train_draft(
        data_dir, args.target, args.out, train_config, parent_dir=args.parent, metrics=sink
    )
    echo(json.dumps({**dataclasses.asdict(result), "draft_dir": str(result.draft_dir)}, indent=2))
    return 0


def _export_lake_window(config: TideConfig, slug: str, after: str | None, out_dir: Path) -> None:
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415

    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    shards = reader.list_shards(slug, after=after)
    if not shards:
        raise FileNotFoundError(f"the lake holds no committed shards for target {slug!r}")
    count = reader.export_specforge(shards, out_dir)
    echo(f"exported {count} samples from {len(shards)} shards to {out_dir}")


def config_from_args(args: argparse.Namespace, base: StrictModel) -> Any:
    """``base`` with every ``--option`` the user gave, validated by the model."""
    given = {
        name: getattr(args, name)
        for name in type(base).model_fields
        if getattr(args, name, None) is not None
    }
    return type(base).model_validate({**base.model_dump(), **given})


def add_config_options(
    parser: argparse.ArgumentParser,
    model: type[StrictModel],
    title: str = "defaults from TIDE_* settings",
) -> None:
    """One ``--field`` per scalar (or list-of-scalar) field of a model: the CLI mirrors it."""
    group = parser.add_argument_group(f"{model.__name__} ({title})")
    for name, field in model.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description or ''} (default: {default})"
        parsing = _parsing(field.annotation)
        if parsing is not None:
            group.add_argument(flag, dest=name, default=None, help=help_text, **parsing)


def _parsing(annotation: Any) -> dict[str, Any] | None:
    """How argparse parses a field of this type; None for a type the CLI does not offer."""
    if get_origin(annotation) in (Union, UnionType):  # X | None
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    nargs = None
    if get_origin(annotation) in (tuple, list):  # several values: --ks 3 5
        annotation, nargs = get_args(annotation)[0], "+"
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    choices = get_args(annotation) if get_origin(annotation) is Literal else None
    converter = _CONVERTERS.get(str if choices else annotation)
    if converter is None:
        return None
    return {"type": converter, "nargs": nargs, "choices": choices}


# -- parser -----------------------------------------------------------------------------


def add_command(
    parent: Commands, command: tuple[str, Handler], summary: str
) -> argparse.ArgumentParser:
    """``parent NAME``, run by its handler: ``summary`` in the list of commands, and the
    handler's docstring (as click does) as the description of ``NAME --help``."""
    name, handler = command
    parser = parent.add_parser(name, help=summary, description=inspect.getdoc(handler) or summary)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """``tide``'s parser; each command group is added by a function of its own below."""
    parser = argparse.ArgumentParser(
        prog="tide",
        description=(
            "TIDE keeps EAGLE3 draft models fitted to live traffic: serving captures the "
            "target's hidden states into S3, Airflow retrains the draft with SpecForge, "
            "MLflow registers it, and the fleet hot-swaps it in."
        ),
        epilog=(
            "Configuration: environment variables TIDE_<SECTION>__<FIELD> "
            "(e.g. TIDE_STORE__ENDPOINT=http://minio:9000) or a YAML/JSON file in TIDE_CONFIG."
        ),
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much to log (default INFO)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add_group in (
        _add_stack,
        _add_lake,
        _add_target,
        _add_train,
        _add_serve,
        _add_fleet,
        _add_eval,
    ):
        add_group(commands)
    # Groups of other packages (the harness: bench, workload, demo) register themselves
    # as entry points, so the product never imports them.
    for plugin in sorted(entry_points(group=COMMAND_PLUGINS), key=lambda e: e.name):
        try:
            plugin.load()(commands)
        except Exception as error:  # a broken extra never takes `serve` or `fleet` down
            logger.warning("`tide %s` is unavailable: %s: %s", plugin.name, plugin.value, error)
    return parser


def _add_stack(commands: Commands) -> None:
    """``tide stack up|down|status``: the local services."""
    stack = commands.add_parser(
        "stack",
        help="start/stop the local services: S3 (SeaweedFS), MLflow, and Airflow "
        "unless TIDE_STACK__AIRFLOW=false",
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    stack.add_parser(
        "up", help="start every service, create buckets, wait until healthy (idempotent)"
    ).set_defaults(handler=_stack_up)
    stack.add_parser("down", help="stop every service started by `up`").set_defaults(
        handler=_stack_down
    )
    stack.add_parser(
        "status", help="show each service; exit 1 unless all are healthy"
    ).set_defaults(handler=_stack_status)


def _add_lake(commands: Commands) -> None:
    """``tide lake stats``."""
    lake = commands.add_parser("lake", help="inspect the hidden-state lake").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    stats = lake.add_parser("stats", help="committed shards, records and tokens per partition")
    stats.add_argument("--target", help="only this target slug (default: every target)")
    stats.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    stats.set_defaults(handler=_lake_stats)


def _add_target(commands: Commands) -> None:
    """``tide target build``."""
    target = commands.add_parser("target", help="the demo target model").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    build = add_command(
        target,
        ("build", _target_build),
        "train the demo target on packaged text (cached; a few minutes for 'demo')",
    )
    build.add_argument(
        "--preset",
        default="demo",
        choices=["demo", "tiny"],
        help="demo: the demo's target (about 15 min on 2 cores); tiny: the tests' (seconds)",
    )
    build.add_argument("--seed", type=int, default=0, help="seed of weights and training order")
    build.add_argument("--out", type=Path, help="default: .tide/targets/<preset>")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")


def _add_train(commands: Commands) -> None:
    """``tide train``."""
    train = add_command(
        commands, ("train", _train), "train an EAGLE3 draft (SpecForge) on captured hidden states"
    )
    train.add_argument("--target", type=Path, required=True, help="HF target model directory")
    train.add_argument("--out", type=Path, required=True, help="run directory")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="samples in SpecForge's offline layout")
    source.add_argument("--lake-target", help="train on this target slug's committed lake shards")
    train.add_argument("--after", help="with --lake-target: only shards after this watermark")
    train.add_argument("--parent", type=Path, help="exported draft to warm-start from")
    train.add_argument("--mlflow-run-id", help="log per-step metrics to this MLflow run")
    add_config_options(train, TrainConfig)


def _add_serve(commands: Commands) -> None:
    """``tide serve``."""
    summary = "the reference engine: SGLang's HTTP API over an HF target with EAGLE3 + capture"
    add_config_options(add_command(commands, ("serve", _serve), summary), ServeConfig)


def _add_fleet(commands: Commands) -> None:
    """``tide fleet status|promote|rollback|tune-k``."""
    fleet = commands.add_parser(
        "fleet", help="status, promotion and rollback of drafts on SGLang-compatible servers"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("status", "health, weight version, acceptance length and draft of each server"),
        ("promote", "serve a draft on every server, one at a time; roll all back on failure"),
        ("rollback", "serve an earlier draft on every server (no acceptance gate)"),
        (
            "tune-k",
            "the number of draft tokens k that pays on each server, from the acceptance "
            "it reports; --apply relaunches those that differ (restart rollout)",
        ),
    ):
        sub = fleet.add_parser(action, help=text, description=text)
        sub.add_argument("--servers", required=True, help="comma-separated base URLs")
        if action == "tune-k":
            sub.add_argument(
                "--draft-cost-ratio",
                type=float,
                required=True,
                help="time of one draft forward / one plain decode step (measure it once)",
            )
            sub.add_argument(
                "--verify-token-cost-ratio",
                type=float,
                default=0.0,
                help="extra verify time per drafted token / plain step (about 0 on a GPU)",
            )
            sub.add_argument("--max-k", type=int, help="default: each server's launch k")
            sub.add_argument(
                "--apply",
                action="store_true",
                help="relaunch servers with their best k through fleet.restart_command",
            )
        elif action != "status":
            sub.add_argument("--model-path", required=True, help="draft directory or s3:// URI")
            sub.add_argument("--weight-version", required=True, help="version the servers report")
        if action == "promote":
            sub.add_argument(
                "--probe-prompt", action="append", help="prompt for the acceptance check"
            )
            sub.add_argument(
                "--min-accept-length",
                type=float,
                help="fail (and roll back) below this on the probes",
            )
        sub.set_defaults(handler=_fleet)


def _add_eval(commands: Commands) -> None:
    """``tide eval offline|online``."""
    evaluate = commands.add_parser(
        "eval",
        help="acceptance length of a draft: offline from captured states, or online on a server",
        description=(
            "offline: replays greedy chain drafting of DRAFT against the target states captured "
            "in the lake (no target forward pass) and reports the acceptance length (tokens "
            "emitted per verify step, bonus included, pooled as SGLang pools it) per traffic "
            "segment ('recent' and, with --recent-since, 'older') for each k. Exact for greedy "
            "traffic. online: sends prompts to a live SGLang-compatible server and pools the "
            "acceptance length and output tokens/s from its responses."
        ),
    ).add_subparsers(dest="action", required=True, metavar="MODE")
    offline = evaluate.add_parser("offline", help="from captured lake data, per segment and k")
    offline.add_argument("--draft", type=Path, required=True, help="exported draft directory")
    offline.add_argument("--target", type=Path, required=True, help="HF target directory")
    offline.add_argument("--lake-target", required=True, help="target slug in the lake")
    offline.add_argument("--recent-since", help="ISO time: requests finished after it are 'recent'")
    offline.add_argument("--k", type=int, action="append", help="draft tokens per verify (repeat)")
    offline.set_defaults(handler=_eval)
    online = evaluate.add_parser("online", help="replay prompts against a live server")
    online.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:30000")
    online.add_argument("--prompts", type=Path, required=True, help="text file, one prompt a line")
    online.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens generated per request"
    )
    online.set_defaults(handler=_eval)


def _one_line(error: BaseException) -> str:
    """The error's message on one line (a ConfigError lists its fields on several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    joined = [line if line.endswith(":") else f"{line};" for line in lines[:-1]]
    return " ".join([*joined, *lines[-1:]])


def main(argv: list[str] | None = None) -> int:
    """Run one command; a TIDE error (or a missing file) is one line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
    handler: Handler = args.handler
    try:
        config = load_config()
        return handler(args, config)
    except ValidationError as error:  # a model built from arguments, not from the environment
        problems = [
            f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
            for item in error.errors(include_input=False, include_url=False)
        ]
        logger.error("invalid arguments: %s", "; ".join(problems))
    except (TideError, FileNotFoundError) as error:
        logger.error("%s", _one_line(error))
    return 2


if __name__ == "__main__":
    sys.exit(main())

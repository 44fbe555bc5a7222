"""``tide``: the command line of TIDE.

Each subcommand parses its arguments, loads the typed configuration once, and
calls one library function; errors that a user can fix are printed as one
readable line (exit code 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from datetime import datetime
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

__all__ = ["main"]

logger = logging.getLogger("tide")

Handler = Callable[[argparse.Namespace, TideConfig], int]
# What add_subparsers returns (argparse names its class privately).
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
DEFAULT_TARGETS = Path(".tide/targets")
_CONVERTERS: dict[object, Callable[[str], Any]] = {int: int, float: float, str: str, Path: Path}


def _out(text: str = "") -> None:
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
    _out("stack stopped")
    return 0


def _stack_status(_args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.stack import StackManager  # noqa: PLC0415

    statuses = StackManager(config).status()
    _print_status(statuses)
    return 0 if all(status.healthy for status in statuses) else 1


def _print_status(statuses: list[ServiceStatus]) -> None:
    _out(f"{'service':<12}{'state':<10}{'pid':>8}  url / log")
    for status in statuses:
        state = "healthy" if status.healthy else ("starting" if status.running else "stopped")
        _out(f"{status.name:<12}{state:<10}{status.pid or '-':>8}  {status.url}  ({status.log})")


# -- lake -------------------------------------------------------------------------------


def _lake_stats(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415
    from tide_lib.lake.reader import partition_stats  # noqa: PLC0415

    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    slugs = [args.target] if args.target else reader.list_targets()
    rows = partition_stats(reader, slugs)
    if args.json:
        _out(json.dumps([dataclasses.asdict(row) for row in rows]))
        return 0
    if not rows:
        _out(f"no committed shards in s3://{config.store.lake_bucket}/{config.lake.prefix}/")
        return 0
    _out(f"{'target':<32}{'partition':<24}{'shards':>8}{'records':>9}{'tokens':>11}{'MB':>9}")
    for row in rows:
        _out(
            f"{row.target_slug:<32}{row.partition:<24}{row.shards:>8}{row.records:>9}"
            f"{row.tokens:>11}{row.size_bytes / 1e6:>9.1f}"
        )
    _out(
        f"{'total':<56}{sum(r.shards for r in rows):>8}{sum(r.records for r in rows):>9}"
        f"{sum(r.tokens for r in rows):>11}{sum(r.size_bytes for r in rows) / 1e6:>9.1f}"
    )
    return 0


# -- bench ------------------------------------------------------------------------------


def _bench_lake(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.lake.bench import HEADLINE_KEYS, LakeBenchParams, run_lake_bench  # noqa: PLC0415

    params = LakeBenchParams(
        records=args.records, tokens_per_record=args.tokens, hidden_size=args.hidden_size
    )
    result = run_lake_bench(config, params, args.json)
    for key in HEADLINE_KEYS:
        _out(f"{key:<28}{result[key]:>14.1f}")
    if args.json:
        _out(f"wrote {args.json}")
    return 0


def _bench_cycle(args: argparse.Namespace, config: TideConfig) -> int:
    import tempfile  # noqa: PLC0415

    from tide_lib.harness.cycle_bench import CycleBenchParams, run_cycle_bench  # noqa: PLC0415

    params = CycleBenchParams(scales=tuple(args.scales), older_shards=args.older_shards)
    with tempfile.TemporaryDirectory(prefix="tide-bench-cycle-") as tmp:
        result = run_cycle_bench(config, params, Path(tmp))
    _out(f"{'scale':>6}{'older shards':>14}{'seconds':>10}{'MB read':>10}{'listed':>8}{'GETs':>7}")
    for row in result.scales:
        _out(
            f"{row.scale:>5}x{row.older_shards:>14}{row.seconds['total']:>10.2f}"
            f"{row.bytes_read / 1e6:>10.2f}{row.objects_listed:>8}{row.gets:>7}"
        )
    ratios = result.ratios()
    _out("largest/1x: " + ", ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        _out(f"wrote {args.json}")
    return 0


def _bench_train(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.training.bench import TrainBenchParams, run_train_bench  # noqa: PLC0415

    params = TrainBenchParams(samples=args.samples, steps=args.steps)
    result = run_train_bench(config, params, args.target or DEFAULT_TARGETS / "demo", args.json)
    for key in (
        "reuse_tokens_per_s",
        "recompute_tokens_per_s",
        "recompute_over_reuse_time",
        "peak_rss_mb",
    ):
        _out(f"{key:<28}{result[key]:>14.2f}")
    for name, shape in result["shapes"].items():
        _out(f"  {name:<26}recompute/reuse time {shape['recompute_over_reuse_time']:.2f}x")
    if args.json:
        _out(f"wrote {args.json}")
    return 0


# -- serving ---------------------------------------------------------------------------------


def _serve(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.serving.server import run_server  # noqa: PLC0415

    run_server(config.model_copy(update={"serve": _config_from_args(args, config.serve)}))
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
    _out(f"{'server':<32}{'health':<9}{'version':<20}{'accept len':>11}  draft")
    for state in states:
        accept = f"{state.avg_accept_length:.2f}" if state.avg_accept_length is not None else "-"
        health = "ok" if state.healthy else "DOWN"
        _out(
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
    _out(f"{'server':<32}{'k now':>6}{'accept len':>11}{'best k':>7}  tokens per plain step")
    for state in fleet.status():
        choice = choices.get(state.url)
        accept = f"{state.avg_accept_length:.2f}" if state.avg_accept_length is not None else "-"
        best = str(choice.k) if choice is not None else "-"
        rates = " ".join(f"{r:.2f}" for r in choice.tokens_per_s) if choice is not None else ""
        now = state.speculative_num_steps or "-"
        _out(f"{state.url:<32}{now:>6}{accept:>11}{best:>7}  {rates}")
    if not args.apply:
        return 0
    try:
        relaunched = fleet.apply_k(choices)
    except FleetError as error:
        logger.error("%s", error)
        return 1
    _out(f"relaunched with their best k: {', '.join(relaunched) or 'none'}")
    return 0


def _bench_serve(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.serving.bench import HEADLINE_KEYS as SERVE_HEADLINE_KEYS  # noqa: PLC0415
    from tide_lib.serving.bench import run_serve_bench  # noqa: PLC0415

    result = run_serve_bench(
        config,
        args.target or DEFAULT_TARGETS / "demo",
        args.json,
        draft_dir=args.draft,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        num_steps=args.speculative_num_steps,
        warmup=args.warmup,
    )
    for key in SERVE_HEADLINE_KEYS:
        _out(f"{key:<28}{result[key]:>14.2f}")
    if args.json:
        _out(f"wrote {args.json}")
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
        _out(json.dumps(dataclasses.asdict(online), indent=2))
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
            name: reader.iter_samples(
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
    _out(json.dumps(table, indent=2))
    return 0


def _bench_adaptation(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.orchestration.bench import run_adaptation_bench  # noqa: PLC0415

    result = run_adaptation_bench(
        config,
        args.workload,
        args.json,
        target_dir=args.target or DEFAULT_TARGETS / "demo",
        cycle_tokens=args.cycle_tokens,
        max_new_tokens=args.max_new_tokens,
        labels=args.labels,
    )
    keys = ("al_ratio_adapted_static", "al_ratio_adapted_oracle", "retention", "cycle_outcomes")
    _out(json.dumps({k: result[k] for k in keys}))
    static, adapted = result["tokens_per_s_static"], result["tokens_per_s_adapted"]
    plain = result["tokens_per_s_plain"]
    _out(f"tokens/s static {static:.1f}, adapted {adapted:.1f}, plain {plain:.1f}")
    if args.json:
        _out(f"wrote {args.json}")
    return 0


def _workload_segments(args: argparse.Namespace, _config: TideConfig) -> int:
    from tide_lib.orchestration.bench import WorkloadError, segments_workload  # noqa: PLC0415

    plan = []
    for part in args.plan.split(","):
        name, _, count = part.partition(":")
        if not count.isdigit():
            logger.error("--plan: %r is not SEGMENT:REQUESTS (e.g. korean:100)", part)
            return 2
        plan.append((name.strip(), int(count)))
    try:
        path = segments_workload(args.out, plan, max_new_tokens=args.max_new_tokens)
    except WorkloadError as error:
        logger.error("%s", error)
        return 2
    _out(str(path))
    return 0


def _workload_demo(args: argparse.Namespace, _config: TideConfig) -> int:
    from tide_lib.orchestration.bench import demo_workload  # noqa: PLC0415

    _out(str(demo_workload(args.out, english=args.english, korean=args.korean)))
    return 0


# -- target and training ------------------------------------------------------------------


def _target_build(args: argparse.Namespace, _config: TideConfig) -> int:
    from tide_lib.target import build_target  # noqa: PLC0415

    out = args.out or DEFAULT_TARGETS / args.preset
    info = build_target(out, preset_name=args.preset, seed=args.seed, force=args.force)
    _out(json.dumps({"path": str(out), **{k: v for k, v in info.items() if k != "key"}}, indent=2))
    return 0


def _train(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.training.trainer import train_draft  # noqa: PLC0415

    train_config = _config_from_args(args, config.training)
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
    _out(json.dumps({**dataclasses.asdict(result), "draft_dir": str(result.draft_dir)}, indent=2))
    return 0


def _export_lake_window(config: TideConfig, slug: str, after: str | None, out_dir: Path) -> None:
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415

    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    shards = reader.list_shards(slug, after=after)
    if not shards:
        raise FileNotFoundError(f"the lake holds no committed shards for target {slug!r}")
    count = reader.export_specforge(shards, out_dir)
    _out(f"exported {count} samples from {len(shards)} shards to {out_dir}")


def _config_from_args(args: argparse.Namespace, base: StrictModel) -> Any:
    """``base`` with every ``--option`` the user gave, validated by the model."""
    given = {
        name: getattr(args, name)
        for name in type(base).model_fields
        if getattr(args, name, None) is not None
    }
    return type(base).model_validate({**base.model_dump(), **given})


def _add_config_options(parser: argparse.ArgumentParser, model: type[StrictModel]) -> None:
    """One ``--field`` per scalar field of a config section: the CLI mirrors the config."""
    group = parser.add_argument_group(f"{model.__name__} (defaults from TIDE_* settings)")
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if get_origin(annotation) in (Union, UnionType):  # X | None
            annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
        flag = f"--{name.replace('_', '-')}"
        help_text = f"{field.description or ''} (default: {field.default})"
        if annotation is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        choices = get_args(annotation) if get_origin(annotation) is Literal else None
        converter = _CONVERTERS.get(str if choices else annotation)
        if converter is None:
            continue
        group.add_argument(
            flag, dest=name, type=converter, choices=choices, default=None, help=help_text
        )


# -- demo -------------------------------------------------------------------------------


def _demo(args: argparse.Namespace, config: TideConfig) -> int:
    from tide_lib.orchestration.demo import DemoSettings, run_demo  # noqa: PLC0415
    from tide_lib.stack import StackManager  # noqa: PLC0415

    settings = _config_from_args(args, DemoSettings())
    manager = StackManager(config)
    try:
        summary = run_demo(
            config,
            settings,
            target_dir=DEFAULT_TARGETS / settings.preset,
            work_dir=Path(".tide/demo"),
            out_json=args.json,
            out_png=args.plot,
            say=_out,
        )
        final = summary["final"]
        _out(
            f"\n{len(summary['cycles'])} cycles in {summary['minutes_total']:.1f} min; promotions:"
        )
        for promotion in summary["promotions"]:
            _out(f"  {promotion['minutes']:5.1f} min  {promotion['version']}")
        if final.get("ratio_serving_static"):
            _out(
                f"acceptance length on Korean traffic (k={summary['k']}): serving "
                f"{final['accept_length_serving']:.2f}, static "
                f"{final['accept_length_static']:.2f} ({final['ratio_serving_static']:.2f}x)"
            )
        _out(f"wrote {args.json} and {args.plot}")
        _out(f"Airflow: {summary['urls']['airflow']}  (DAG tide_adaptation)")
        _out(f"MLflow:  {summary['urls']['mlflow']}  (model tide-draft-{summary['target_id']})")
        if args.keep_up:
            _out("the UIs stay up until Ctrl-C")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if not args.keep_running:
            manager.down()
            _out("stack stopped")
    return 0


# -- parser -----------------------------------------------------------------------------


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
        _add_bench,
        _add_target,
        _add_train,
        _add_serve,
        _add_fleet,
        _add_eval,
        _add_workload,
        _add_demo,
    ):
        add_group(commands)
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


def _add_bench(commands: Commands) -> None:
    """``tide bench ...``: every benchmark, each writing JSON."""
    bench = commands.add_parser("bench", help="benchmarks that write JSON").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    for add_bench in (
        _add_bench_lake,
        _add_bench_cycle,
        _add_bench_train,
        _add_bench_serve,
        _add_bench_adaptation,
    ):
        add_bench(bench)


def _add_bench_lake(bench: Commands) -> None:
    """``tide bench lake``."""
    bench_lake = bench.add_parser(
        "lake",
        help="capture write/read throughput, bytes per token, writer cost per record",
        description="Needs the S3 server up (`tide stack up`). Cleans up its own shards.",
    )
    bench_lake.add_argument("--json", type=Path, help="write the results to this file")
    bench_lake.add_argument("--records", type=int, default=256, help="records to write")
    bench_lake.add_argument("--tokens", type=int, default=256, help="tokens per record")
    bench_lake.add_argument("--hidden-size", type=int, default=1024, help="target hidden size H")
    bench_lake.set_defaults(handler=_bench_lake)


def _add_bench_cycle(bench: Commands) -> None:
    """``tide bench cycle``."""
    bench_cycle = bench.add_parser(
        "cycle",
        help="a cycle's data I/O (snapshot, export, held-out read) as the lake grows older",
        description=(
            "Builds older lakes of 1x, 10x, 100x consumed shards at the same traffic rate, "
            "adds a new window, and runs the cycle's data steps on each: wall time, bytes "
            "read from S3, objects listed. Needs the S3 server (`tide stack up`); removes "
            "its own objects."
        ),
    )
    bench_cycle.add_argument("--json", type=Path, help="write the results to this file")
    bench_cycle.add_argument(
        "--scales", type=int, nargs="+", default=[1, 10, 100], help="older-lake sizes"
    )
    bench_cycle.add_argument(
        "--older-shards", type=int, default=24, help="older shards at 1x (over the lookback)"
    )
    bench_cycle.set_defaults(handler=_bench_cycle)


def _add_bench_train(bench: Commands) -> None:
    """``tide bench train``."""
    bench_train = bench.add_parser(
        "train",
        help="draft training tokens/s on captured states vs recomputing them; peak memory",
        description=(
            "Needs the S3 server up (`tide stack up`): captures go through the real lake. "
            "Builds the demo target if it is not cached. Reports the demo target and a "
            "random-weight target shaped like Llama-3.1-8B scaled down."
        ),
    )
    bench_train.add_argument("--json", type=Path, help="write the results to this file")
    bench_train.add_argument(
        "--target", type=Path, help="demo target dir (default: .tide/targets/demo)"
    )
    bench_train.add_argument("--samples", type=int, default=64, help="captured requests")
    bench_train.add_argument("--steps", type=int, default=16, help="optimizer steps per mode")
    bench_train.set_defaults(handler=_bench_train)


def _add_bench_serve(bench: Commands) -> None:
    """``tide bench serve``."""
    bench_serve = bench.add_parser(
        "serve",
        help=(
            "capture overhead; fixed-k, adaptive-k and plain tokens/s side by side, with the "
            "k adaptive chose; accept length; swap latency"
        ),
        description=(
            "Needs the S3 server up (capture writes to the lake). Without --draft, bootstraps a "
            "draft from the demo target's own greedy answers to English prompts (~3 minutes)."
        ),
    )
    bench_serve.add_argument("--json", type=Path, help="write the results to this file")
    bench_serve.add_argument("--target", type=Path, help="target dir (default: .tide/targets/demo)")
    bench_serve.add_argument("--draft", type=Path, help="exported draft to serve")
    bench_serve.add_argument("--prompts", type=int, default=24, help="held-out prompts per pair")
    bench_serve.add_argument(
        "--max-new-tokens", type=int, default=48, help="tokens generated per request"
    )
    bench_serve.add_argument(
        "--speculative-num-steps", type=int, default=4, help="k, and adaptive k's largest"
    )
    bench_serve.add_argument(
        "--warmup", type=int, default=4, help="untimed requests per engine before measuring"
    )
    bench_serve.set_defaults(handler=_bench_serve)


def _add_bench_adaptation(bench: Commands) -> None:
    """``tide bench adaptation``."""
    bench_adaptation = bench.add_parser(
        "adaptation",
        help="the TIDE loop headless on a workload: AL per draft/segment/k, ratios, tokens/s",
        description=(
            "Workload: JSONL, one request per line in arrival order, "
            '{"prompt": ..., "segment": ..., "max_new_tokens": ...}; the last segment to appear '
            "is the new traffic (one segment: a workload without shift). Needs the S3 and "
            "MLflow servers up (`tide stack up`)."
        ),
    )
    bench_adaptation.add_argument(
        "--workload",
        type=Path,
        required=True,
        help="JSONL, one request per line in arrival order (`tide workload demo` writes one)",
    )
    bench_adaptation.add_argument("--json", type=Path, help="write the results to this file")
    bench_adaptation.add_argument("--target", type=Path, help="default: .tide/targets/demo")
    bench_adaptation.add_argument(
        "--cycle-tokens", type=int, default=1500, help="new tokens per cycle"
    )
    bench_adaptation.add_argument(
        "--max-new-tokens", type=int, default=48, help="tokens per request without its own"
    )
    bench_adaptation.add_argument(
        "--labels",
        action="store_true",
        help="send each request's segment as a client label (custom_labels); "
        "default: unlabelled, segments come from the cycles' clusters",
    )
    bench_adaptation.set_defaults(handler=_bench_adaptation)


def _add_target(commands: Commands) -> None:
    """``tide target build``."""
    target = commands.add_parser("target", help="the demo target model").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    build = target.add_parser(
        "build",
        help="train the demo target on packaged text (cached; a few minutes for 'demo')",
        description=(
            "Builds a small Llama-architecture target in HF format (config, safetensors, "
            "tokenizer) from English/Korean conversations and documentation shipped in "
            "installed packages. Reused when already built with the same preset and seed."
        ),
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
    build.set_defaults(handler=_target_build)


def _add_train(commands: Commands) -> None:
    """``tide train``."""
    train = commands.add_parser(
        "train",
        help="train an EAGLE3 draft (SpecForge) on captured hidden states",
        description=(
            "Trains SpecForge's LlamaForCausalLMEagle3 with its EAGLE3 objective on a window "
            "of captured target states, warm-started from --parent if given. Checkpoints go "
            "to OUT/checkpoints (a rerun resumes), the SGLang-loadable draft to OUT/draft. "
            "Multi-GPU: run under torchrun with --device cuda."
        ),
    )
    train.add_argument("--target", type=Path, required=True, help="HF target model directory")
    train.add_argument("--out", type=Path, required=True, help="run directory")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="samples in SpecForge's offline layout")
    source.add_argument("--lake-target", help="train on this target slug's committed lake shards")
    train.add_argument("--after", help="with --lake-target: only shards after this watermark")
    train.add_argument("--parent", type=Path, help="exported draft to warm-start from")
    train.add_argument("--mlflow-run-id", help="log per-step metrics to this MLflow run")
    _add_config_options(train, TrainConfig)
    train.set_defaults(handler=_train)


def _add_serve(commands: Commands) -> None:
    """``tide serve``."""
    serve = commands.add_parser(
        "serve",
        help="the reference engine: SGLang's HTTP API over an HF target with EAGLE3 + capture",
        description=(
            "Serves POST /generate, GET /health, /model_info, /server_info, /metrics, "
            "and POST /update_weights_from_disk with SGLang's field names. Chain drafting with "
            "--speculative-num-steps draft tokens per verify; captured hidden states go to the "
            "lake configured by TIDE_STORE__* / TIDE_LAKE__*."
        ),
    )
    _add_config_options(serve, ServeConfig)
    serve.set_defaults(handler=_serve)


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


def _add_workload(commands: Commands) -> None:
    """``tide workload demo|segments``."""
    workload = commands.add_parser("workload", help="workload files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    workload_demo = workload.add_parser("demo", help="English then Korean conversation (JSONL)")
    workload_demo.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    workload_demo.add_argument("--english", type=int, default=60, help="English requests first")
    workload_demo.add_argument("--korean", type=int, default=120, help="Korean requests then")
    workload_demo.set_defaults(handler=_workload_demo)
    workload_segments = workload.add_parser(
        "segments",
        help="segments arriving in turn, from the packaged corpora (JSONL)",
        description=(
            "Segments: english (conversation), english-docs (Python documentation), "
            "korean (conversation), korean-law (Korean law). A document request is its first "
            "words; the target continues it."
        ),
    )
    workload_segments.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    workload_segments.add_argument(
        "--plan",
        default="english:60,english-docs:60,korean:100,korean-law:60",
        help="SEGMENT:REQUESTS,... in arrival order",
    )
    workload_segments.add_argument(
        "--max-new-tokens", type=int, default=48, help="tokens generated per request"
    )
    workload_segments.set_defaults(handler=_workload_segments)


def _add_demo(commands: Commands) -> None:
    """``tide demo``."""
    demo = commands.add_parser(
        "demo",
        help="the TIDE loop on this machine, driven by the Airflow scheduler",
        description=(
            "Starts the stack and a fleet of reference engines serving a static English "
            "draft with capture on, replays Korean conversations against it, and lets "
            "the Airflow scheduler run tide_adaptation cycle after cycle while a live "
            "table shows the acceptance length of the serving draft and of the static "
            "draft on the same traffic. Writes a JSON summary and a PNG at the end."
        ),
    )
    from tide_lib.orchestration.demo import DemoSettings  # noqa: PLC0415

    _add_config_options(demo, DemoSettings)
    demo.add_argument("--json", type=Path, default=Path("bench/demo.json"), help="summary")
    demo.add_argument("--plot", type=Path, default=Path("bench/demo.png"), help="PNG plot")
    demo.add_argument("--keep-up", action="store_true", help="keep the UIs up until Ctrl-C")
    demo.add_argument("--keep-running", action="store_true", help="leave the stack running on exit")
    demo.set_defaults(handler=_demo)


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

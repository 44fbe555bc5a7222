"""The harness's commands of ``tide``: ``bench ...``, ``workload ...`` and ``demo``.

They live apart from the product's CLI: ``tide_lib.cli`` finds them through the
``tide.commands`` entry points (``pyproject.toml``), so nothing in the product
imports the harness.
"""

from __future__ import annotations

__all__ = ["add_bench_commands", "add_demo_command", "add_workload_commands"]

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tide_lib.cli import (
    DEFAULT_TARGETS,
    Commands,
    add_command,
    add_config_options,
    config_from_args,
    echo,
)
from tide_lib.config import TideConfig
from tide_lib.harness.params import (
    AdaptationBenchParams,
    CycleBenchParams,
    DemoSettings,
    LakeBenchParams,
    ServeBenchParams,
    SuiteParams,
    TrainBenchParams,
)

logger = logging.getLogger("tide")


def _echo_figures(
    result: dict[str, Any], keys: Iterable[str], json_path: Path | None, spec: str = ".2f"
) -> None:
    """One aligned line per headline figure, then where the JSON went."""
    for key in keys:
        echo(f"{key:<28}{result[key]:>14{spec}}")
    if json_path:
        echo(f"wrote {json_path}")


def _bench_lake(args: argparse.Namespace, config: TideConfig) -> int:
    """Needs the S3 server up (`tide stack up`). Cleans up its own shards."""
    from tide_lib.harness.lake_bench import HEADLINE_KEYS, run_lake_bench  # noqa: PLC0415

    result = run_lake_bench(config, config_from_args(args, LakeBenchParams()), args.json)
    _echo_figures(result, HEADLINE_KEYS, args.json, ".1f")
    return 0


def _bench_cycle(args: argparse.Namespace, config: TideConfig) -> int:
    """Builds older lakes of 1x, 10x, 100x consumed shards at the same traffic rate, adds a
    new window, and runs the cycle's data steps on each: wall time, bytes read from S3,
    objects listed. Needs the S3 server (`tide stack up`); removes its own objects.
    """
    import tempfile  # noqa: PLC0415

    from tide_lib.harness.cycle_bench import run_cycle_bench  # noqa: PLC0415

    params = config_from_args(args, CycleBenchParams())
    with tempfile.TemporaryDirectory(prefix="tide-bench-cycle-") as tmp:
        result = run_cycle_bench(config, params, Path(tmp))
    echo(f"{'scale':>6}{'older shards':>14}{'seconds':>10}{'MB read':>10}{'listed':>8}{'GETs':>7}")
    for row in result.scales:
        echo(
            f"{row.scale:>5}x{row.older_shards:>14}{row.seconds['total']:>10.2f}"
            f"{row.bytes_read / 1e6:>10.2f}{row.objects_listed:>8}{row.gets:>7}"
        )
    ratios = result.ratios()
    echo("largest/1x: " + ", ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        echo(f"wrote {args.json}")
    return 0


def _bench_train(args: argparse.Namespace, config: TideConfig) -> int:
    """Needs the S3 server up (`tide stack up`): captures go through the real lake. Builds
    the demo target if it is not cached. Reports the demo target and a random-weight
    target shaped like Llama-3.1-8B scaled down.
    """
    from tide_lib.harness.train_bench import run_train_bench  # noqa: PLC0415

    params = config_from_args(args, TrainBenchParams())
    result = run_train_bench(config, params, args.target or DEFAULT_TARGETS / "demo", args.json)
    keys = ("reuse_tokens_per_s", "recompute_tokens_per_s", "recompute_over_reuse_time")
    _echo_figures(result, (*keys, "peak_rss_mb"), None)
    for name, shape in result["shapes"].items():
        echo(f"  {name:<26}recompute/reuse time {shape['recompute_over_reuse_time']:.2f}x")
    _echo_figures(result, (), args.json)
    return 0


def _bench_serve(args: argparse.Namespace, config: TideConfig) -> int:
    """Needs the S3 server up (capture writes to the lake). Without --draft, bootstraps a
    draft from the demo target's own greedy answers to English prompts (~3 minutes).
    """
    from tide_lib.harness.serve_bench import HEADLINE_KEYS as SERVE_HEADLINE_KEYS  # noqa: PLC0415
    from tide_lib.harness.serve_bench import run_serve_bench  # noqa: PLC0415

    params = config_from_args(args, ServeBenchParams())
    result = run_serve_bench(config, args.target or DEFAULT_TARGETS / "demo", args.json, params)
    _echo_figures(result, SERVE_HEADLINE_KEYS, args.json)
    return 0


def _bench_adaptation(args: argparse.Namespace, config: TideConfig) -> int:
    """Workload: JSONL, one request per line in arrival order, {"prompt": ..., "segment":
    ..., "max_new_tokens": ...}; the last segment to appear is the new traffic (one
    segment: a workload without shift). Needs the S3 and MLflow servers up
    (`tide stack up`).
    """
    from tide_lib.harness.adaptation_bench import run_adaptation_bench  # noqa: PLC0415

    params = config_from_args(args, AdaptationBenchParams())
    seed = params.target_seed
    default_target = DEFAULT_TARGETS / ("demo" if seed == 0 else f"demo-seed{seed}")
    result = run_adaptation_bench(
        config, args.workload, args.json, params, target_dir=args.target or default_target
    )
    keys = (
        "al_ratio_adapted_static",
        "al_ratio_adapted_oracle",
        "retention",
        "retention_served",
        "cycle_outcomes",
    )
    echo(json.dumps({k: result[k] for k in keys}))
    static, adapted = result["tokens_per_s_static"], result["tokens_per_s_adapted"]
    adaptive, plain = result["tokens_per_s_adapted_adaptive_k"], result["tokens_per_s_plain"]
    echo(
        f"tokens/s static {static:.1f}, adapted {adapted:.1f}, adapted with adaptive k "
        f"{adaptive:.1f}, plain {plain:.1f}"
    )
    if args.json:
        echo(f"wrote {args.json}")
    return 0


def _figure(value: float | str | None) -> str:
    """A figure as the suite writes it: a number, "never", or None (nothing measured)."""
    return "-" if value is None else value if isinstance(value, str) else f"{value:.3f}"


def _bench_suite(args: argparse.Namespace, config: TideConfig) -> int:
    """Draws --seeds workloads from the packaged corpora (kinds in turn: new, turns, gradual,
    return, served, none; every second one with client labels), runs each through the loop,
    and reports each workload and the suite's median and worst case for every figure, with
    whether each goal holds. Shared drafts (static, one oracle per segment) are cached in
    --cache-dir. Needs the S3 and MLflow servers up (`tide stack up`).
    """
    from tide_lib.harness.suite import run_suite  # noqa: PLC0415

    params = config_from_args(args, SuiteParams())
    seed = params.target_seed
    default_target = DEFAULT_TARGETS / ("demo" if seed == 0 else f"demo-seed{seed}")
    result = run_suite(config, params, args.target or default_target, args.json)
    summary = result["summary"]
    for name, figure in summary.items():
        if isinstance(figure, dict) and "median" in figure:
            median, worst = (_figure(figure[which]) for which in ("median", "worst"))
            echo(f"{name:<28} median {median:>8}  worst {worst:>8}  of {figure['n']}")
    for goal, holds in summary["goals"].items():
        echo(f"{'met' if holds else 'MISSED':>6}  {goal}")
    if args.json:
        echo(f"wrote {args.json}")
    return 0


def _workload_segments(args: argparse.Namespace, _config: TideConfig) -> int:
    """Segments: english (conversation), english-docs (Python documentation), korean
    (conversation), korean-law (Korean law). A document request is its first words; the
    target continues it.
    """
    from tide_lib.harness.adaptation_bench import WorkloadError, segments_workload  # noqa: PLC0415

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
    echo(str(path))
    return 0


def _workload_demo(args: argparse.Namespace, _config: TideConfig) -> int:
    from tide_lib.harness.adaptation_bench import demo_workload  # noqa: PLC0415

    echo(str(demo_workload(args.out, english=args.english, korean=args.korean)))
    return 0


def _demo(args: argparse.Namespace, config: TideConfig) -> int:
    """Starts the stack and a fleet of reference engines serving a static English draft
    with capture on, replays Korean conversations against it, and lets the Airflow
    scheduler run tide_adaptation cycle after cycle while a live table shows the
    acceptance length of the serving draft and of the static draft on the same traffic.
    Writes a JSON summary and a PNG at the end.
    """
    from tide_lib.harness.demo import run_demo  # noqa: PLC0415
    from tide_lib.stack import StackManager  # noqa: PLC0415

    settings = config_from_args(args, DemoSettings())
    manager = StackManager(config)
    try:
        summary = run_demo(
            config,
            settings,
            target_dir=DEFAULT_TARGETS / settings.preset,
            work_dir=Path(".tide/demo"),
            out_json=args.json,
            out_png=args.plot,
            say=echo,
        )
        final = summary["final"]
        echo(
            f"\n{len(summary['cycles'])} cycles in {summary['minutes_total']:.1f} min; promotions:"
        )
        for promotion in summary["promotions"]:
            echo(f"  {promotion['minutes']:5.1f} min  {promotion['version']}")
        if final.get("ratio_serving_static"):
            echo(
                f"acceptance length on Korean traffic (k={summary['k']}): serving "
                f"{final['accept_length_serving']:.2f}, static "
                f"{final['accept_length_static']:.2f} ({final['ratio_serving_static']:.2f}x)"
            )
        echo(f"wrote {args.json} and {args.plot}")
        echo(f"Airflow: {summary['urls']['airflow']}  (DAG tide_adaptation)")
        echo(f"MLflow:  {summary['urls']['mlflow']}  (model tide-draft-{summary['target_id']})")
        if args.keep_up:
            echo("the UIs stay up until Ctrl-C")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if not args.keep_running:
            manager.down()
            echo("stack stopped")
    return 0


def add_bench_commands(commands: Commands) -> None:
    """``tide bench ...``: every benchmark, each writing JSON."""
    bench = commands.add_parser("bench", help="benchmarks that write JSON").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    summaries = {
        "lake": "capture write/read throughput, bytes per token, writer cost per record",
        "cycle": "a cycle's data I/O (snapshot, export, held-out read) as the lake grows older",
        "train": "draft training tokens/s on captured states vs recomputing them; peak memory",
        "serve": "capture overhead; fixed-k, adaptive-k and plain tokens/s side by side, with "
        "the k adaptive chose; accept length; swap latency",
        "adaptation": "the TIDE loop headless on a workload: AL per draft/segment/k, ratios, "
        "tokens/s",
        "suite": "the loop on generated shifts, one workload per seed: each workload's figures, "
        "the suite's median and worst case, the goals met",
    }
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, handler, params, runs_target in (
        ("lake", _bench_lake, LakeBenchParams, False),
        ("cycle", _bench_cycle, CycleBenchParams, False),
        ("train", _bench_train, TrainBenchParams, True),
        ("serve", _bench_serve, ServeBenchParams, True),
        ("adaptation", _bench_adaptation, AdaptationBenchParams, True),
        ("suite", _bench_suite, SuiteParams, True),
    ):
        parser = add_command(bench, (name, handler), summaries[name])
        parser.add_argument("--json", type=Path, help="write the results to this file")
        if runs_target:
            parser.add_argument("--target", type=Path, help="default: .tide/targets/demo")
        add_config_options(parser, params, "benchmark settings")
        parsers[name] = parser
    workload_help = "JSONL, one request per line in arrival order (`tide workload demo`)"
    parsers["adaptation"].add_argument("--workload", type=Path, required=True, help=workload_help)


def add_workload_commands(commands: Commands) -> None:
    """``tide workload demo|segments``."""
    workload = commands.add_parser("workload", help="workload files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    workload_demo = add_command(
        workload, ("demo", _workload_demo), "English then Korean conversation (JSONL)"
    )
    workload_demo.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    workload_demo.add_argument("--english", type=int, default=60, help="English requests first")
    workload_demo.add_argument("--korean", type=int, default=120, help="Korean requests then")
    workload_segments = add_command(
        workload,
        ("segments", _workload_segments),
        "segments arriving in turn, from the packaged corpora (JSONL)",
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


def add_demo_command(commands: Commands) -> None:
    """``tide demo``."""
    demo = add_command(
        commands,
        ("demo", _demo),
        "the TIDE loop on this machine, driven by the Airflow scheduler",
    )
    add_config_options(demo, DemoSettings)
    demo.add_argument("--json", type=Path, default=Path("bench/demo.json"), help="summary")
    demo.add_argument("--plot", type=Path, default=Path("bench/demo.png"), help="PNG plot")
    demo.add_argument("--keep-up", action="store_true", help="keep the UIs up until Ctrl-C")
    demo.add_argument("--keep-running", action="store_true", help="leave the stack running on exit")

"""GPU smoke test: TIDE's SGLang plugin inside a real SGLang server.

Run on a CUDA host with a supported SGLang (0.5.14 or 0.5.23) and TIDE installed beside it, an S3
lake reachable through ``TIDE_STORE__*`` (``tide stack up`` on the same host is
enough) and MLflow if drafts are given as ``models:/`` URIs::

    python scripts/gpu_smoke.py --target /models/llama-3.1-8b \\
        --draft /models/eagle3-a --draft2 /models/eagle3-b --json smoke.json

It checks, in order:

1. capture: greedy prompts (one longer than the chunked-prefill size, two sharing
   a prefix) land in the lake, and each record's final and aux states equal a
   teacher-forced forward of the same target on the same tokens (within the
   tolerance of the served dtype);
2. draft-only swap: ``--draft2`` promoted through ``/update_weights_from_disk``
   (TIDE's hook), the weight version moves, the target's path stays (it was not
   reloaded from the draft) and greedy outputs stay identical (the target
   verifies every token);
3. cost: GPU memory and output tokens/s with capture on, then off (a second
   server), side by side.

Where there is no GPU or no SGLang it says so plainly and exits 2; nothing else
runs. The report goes to stdout and, with ``--json``, to a file.
"""

# ruff: noqa: PLC0415, T201
# (imports wait until the preflight found torch, CUDA and SGLang; a script reports on stdout)
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

PROMPT_SHARED = "Explain, step by step, how a bicycle gear system works"


def preflight() -> str | None:
    """None when this host can run the smoke test, else the reason it cannot."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    from tide_lib.serving.sglang_api import SourceTree, UnsupportedSGLangError, detect

    try:
        detect(SourceTree.installed())
    except UnsupportedSGLangError as error:
        return str(error)
    return None


def _launch(args: argparse.Namespace, capture: bool, prefix: str) -> subprocess.Popen[bytes]:
    from tide_lib.serving.fleet import sglang_launch_args

    command = sglang_launch_args(
        args.target,
        args.draft,
        num_steps=args.num_steps,
        port=args.port,
        host="127.0.0.1",
        extra=["--chunked-prefill-size", str(args.chunk), "--weight-version", "smoke-v1"],
    )
    command[0] = sys.executable
    env = {
        **os.environ,
        "TIDE_SGLANG_CAPTURE": "1" if capture else "0",
        "TIDE_LAKE__PREFIX": prefix,
        "TIDE_LAKE__SHARD_MAX_AGE_S": "1",
        "TIDE_SERVE__SERVED_MODEL_NAME": "smoke",
    }
    log = Path(args.workdir) / f"sglang-capture-{'on' if capture else 'off'}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float = 1200) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SGLang exited with {process.returncode}; see its log")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"SGLang at {url} was not healthy within {timeout:.0f} s")


def _prompts(chunk: int) -> list[str]:
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * (chunk // 4))
    return [long_prompt, f"{PROMPT_SHARED} to a child.", f"{PROMPT_SHARED} to an engineer."]


def _generate(url: str, prompts: list[str], max_new_tokens: int) -> tuple[list[str], float]:
    import httpx

    texts, tokens, started = [], 0, time.perf_counter()
    for prompt in prompts:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}}
        response = httpx.post(f"{url}/generate", json=body, timeout=600)
        response.raise_for_status()
        texts.append(response.json()["text"])
        tokens += response.json()["meta_info"]["completion_tokens"]
    return texts, tokens / (time.perf_counter() - started)


def _model_info(url: str) -> dict[str, Any]:
    import httpx

    info: dict[str, Any] = httpx.get(f"{url}/model_info", timeout=30).json()
    return info


def _gpu_memory_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(line) for line in out.split() if line.strip().isdigit())


def _lake_samples(prefix: str, expected: int, timeout: float = 300) -> list[Any]:
    from tide_lib.config import load_config
    from tide_lib.lake import LakeReader, ObjectStore, target_slug

    config = load_config(lake={"prefix": prefix, "commit_settle_s": 0})
    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    deadline = time.monotonic() + timeout
    while True:
        samples = list(reader.iter_records(reader.list_shards(target_slug("smoke"))))
        if len(samples) >= expected or time.monotonic() > deadline:
            return samples
        time.sleep(2)


def _compare_with_teacher_forcing(
    target: str, prompts: list[str], samples: list[Any]
) -> dict[str, float]:
    """Largest |captured - recomputed| of the final and aux states over every record.

    A record starts after its radix-cached prefix, so each one is matched to its
    prompt and recomputed with that prefix in front, as the server computed it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tide_lib.target_model.hidden import HiddenStateCapture

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_ids = [tokenizer.encode(prompt) for prompt in prompts]
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.bfloat16).cuda().eval()
    capture = HiddenStateCapture(model)
    worst = {"final": 0.0, "aux": 0.0}
    for sample in samples:
        ids = sample.input_ids.tolist()
        in_prompt = int((sample.loss_mask == 0).sum())
        full = next(p for p in prompt_ids if p[len(p) - in_prompt :] == ids[:in_prompt])
        offset = len(full) - in_prompt
        with torch.no_grad(), capture.capturing():
            model.model(input_ids=torch.tensor([full[:offset] + ids]).cuda())
        final, aux = capture.take()
        for name, ours, theirs in (
            ("final", sample.hidden_states, final[0, offset:]),
            ("aux", sample.aux_hidden_states, aux[0, offset:]),
        ):
            difference = (ours.float().cuda() - theirs.float()).abs().max().item()
            worst[name] = max(worst[name], difference)
    return worst


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tide_lib.serving.fleet import FleetManager

    url = f"http://127.0.0.1:{args.port}"
    prefix = f"smoke-{uuid.uuid4().hex[:8]}"
    prompts = _prompts(args.chunk)
    from tide_lib.serving.sglang_api import SourceTree

    version = SourceTree.installed().version()
    report: dict[str, Any] = {"sglang": version, "target": args.target}
    server = _launch(args, capture=True, prefix=prefix)
    try:
        _wait_healthy(url, server)
        report["gpu_memory_mib_capture_on"] = _gpu_memory_mib()
        before, report["tokens_per_s_capture_on"] = _generate(url, prompts, args.max_new_tokens)
        samples = _lake_samples(prefix, expected=len(prompts))
        report["records"] = len(samples)
        report["max_abs_difference"] = _compare_with_teacher_forcing(args.target, prompts, samples)
        launched = _model_info(url)
        FleetManager([url]).promote(args.draft2, "smoke-v2")
        swapped = _model_info(url)
        report["weight_version_after_swap"] = swapped["weight_version"]
        report["target_untouched"] = swapped["model_path"] == launched["model_path"]
        after, _ = _generate(url, prompts, args.max_new_tokens)
        report["greedy_outputs_identical_after_swap"] = before == after
    finally:
        server.terminate()
        server.wait(timeout=120)
    plain = _launch(args, capture=False, prefix=prefix)
    try:
        _wait_healthy(url, plain)
        report["gpu_memory_mib_capture_off"] = _gpu_memory_mib()
        _, report["tokens_per_s_capture_off"] = _generate(url, prompts, args.max_new_tokens)
    finally:
        plain.terminate()
        plain.wait(timeout=120)
    report["passed"] = (
        report["records"] == len(prompts)
        and report["greedy_outputs_identical_after_swap"]
        and report["target_untouched"]
        and report["weight_version_after_swap"] == "smoke-v2"
        and max(report["max_abs_difference"].values()) <= args.tolerance
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HF target model directory")
    parser.add_argument("--draft", required=True, help="EAGLE3 draft served at launch")
    parser.add_argument("--draft2", required=True, help="EAGLE3 draft promoted during the test")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify (k)")
    parser.add_argument("--chunk", type=int, default=128, help="--chunked-prefill-size")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tolerance", type=float, default=0.1, help="max |captured - forward|")
    parser.add_argument("--workdir", default=".tide/gpu-smoke", help="server logs")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    reason = preflight()
    if reason is not None:
        print(f"GPU smoke test not run: {reason}.")
        return 2
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

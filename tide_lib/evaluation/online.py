"""Online acceptance length: replay prompts against a live SGLang-compatible server."""

from __future__ import annotations

__all__ = ["OnlineResult", "online_acceptance"]

import dataclasses
import time
from collections.abc import Sequence

from pydantic import SecretStr

from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.serving.fleet import EngineClient


@dataclasses.dataclass(frozen=True)
class OnlineResult:
    url: str
    weight_version: str
    requests: int
    accept_length: float  # pooled: emitted tokens per verify step over all requests
    output_tokens_per_s: float
    server_avg_accept_length: float | None  # the server's own running figure


def online_acceptance(
    url: str,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    api_key: SecretStr | None = None,
) -> OnlineResult:
    """Send ``prompts`` one by one; pool acceptance length from each response's ``meta_info``."""
    client = EngineClient(url, api_key=api_key)
    count, tokens = AcceptanceCount(), 0
    started = time.perf_counter()
    for prompt in prompts:
        meta = client.generate(prompt, max_new_tokens, temperature)["meta_info"]
        count.add_meta(meta)
        tokens += meta["completion_tokens"]
    seconds = time.perf_counter() - started
    info = client.server_info()
    return OnlineResult(
        url=url,
        weight_version=client.weight_version(),
        requests=len(prompts),
        accept_length=count.accept_length,
        output_tokens_per_s=tokens / seconds if seconds else 0.0,
        server_avg_accept_length=(info.get("internal_states") or [{}])[0].get(
            "avg_spec_accept_length"
        ),
    )

"""Offline acceptance length equals what the engine measured while serving the same requests."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tide_lib.config import TideConfig
from tide_lib.evaluation.offline import acceptance_ceiling, offline_acceptance
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.serving.engine import Engine, EngineRequest
from tide_lib.target_model import load_corpus, render_prompt
from tide_lib.training.draft import load_draft

pytestmark = pytest.mark.slow

# Stored states are float16 (relative error <= 2**-11); the draft's argmax can only flip
# on a near-tie, so replayed acceptance may differ from live serving in rare rounds.
TOLERANCE = 0.05


@pytest.mark.parametrize("num_steps", [3, 5])
def test_offline_acceptance_matches_the_engine(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path: Path,
    num_steps: int,
) -> None:
    prefix = f"eval-offline-k{num_steps}"
    lake = stack.lake.model_copy(
        update={"prefix": prefix, "spool_dir": tmp_path / "spool", "shard_max_age_s": 0.3}
    )
    serve = stack.serve.model_copy(
        update={
            "model_path": tiny_target,
            "speculative_draft_model_path": str(tiny_drafts["en"]),
            "speculative_num_steps": num_steps,
        }
    )
    engine = Engine(stack.model_copy(update={"lake": lake, "serve": serve}))
    emitted = verify = 0.0
    documents = load_corpus().domain("en_chat", held_out=True)[:8]
    try:
        for index, document in enumerate(documents):
            ids = engine.encode(render_prompt(document.turns[0]))
            result = engine.submit(EngineRequest(ids, 40, 0.0, None, f"eval-{index}")).result()
            emitted += result.spec_accept_length * result.spec_verify_ct
            verify += result.spec_verify_ct
    finally:
        engine.close()
    served = emitted / verify

    reader = LakeReader(ObjectStore(stack.store, stack.store.lake_bucket), lake)
    deadline = time.monotonic() + 20
    while reader.count_tokens(target_slug("tiny")) == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    samples = list(reader.iter_records(reader.list_shards(target_slug("tiny"))))
    assert len(samples) == len(documents)
    draft = load_draft(tiny_drafts["en"], tiny_target)
    replayed = offline_acceptance(draft, tiny_target, {"recent": samples}, [num_steps])
    offline = replayed["recent"][num_steps]
    logging.getLogger(__name__).info(
        "k=%d: served %.4f over %d verify steps, offline %.4f over %d",
        num_steps,
        served,
        verify,
        offline.accept_length,
        offline.verify_steps,
    )
    assert offline.requests == len(documents)
    assert offline.verify_steps == verify
    assert abs(offline.accept_length - served) <= TOLERANCE, (offline.accept_length, served)
    assert offline.accept_length <= acceptance_ceiling(samples, num_steps)

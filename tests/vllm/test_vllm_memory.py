"""An engine that a stage opened gives its memory back when the stage ends, as the pipeline needs
between its stages (they run in one process). vLLM's engine core freezes the garbage collector's
view of everything at start (vLLM issue #21073): without the stage's `close` the engine stays."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

from stages import evaluate
from stages.common.config import load_config

GiB = 2**30
KV_CACHE_GB = 2


def eval_config(out):
    return load_config(None, ["rollout.backend=vllm", f"rollout.kv_cache_gb={KV_CACHE_GB}", "rollout.max_turns=1",
                              "rollout.max_new_tokens=8", "eval.seeds=2", "eval.pass_k=1", f"eval.out={out}",
                              "quiet=true"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the process's RAM: the CPU engine's")
def test_an_engine_closed_between_stages_gives_its_memory_back(tmp_path, record_property):
    evaluate.run(eval_config(tmp_path / "first.json"))  # one-off imports and caches stay; they are not the engine's
    process = psutil.Process()
    settled = process.memory_info().rss
    peak, running = [settled], True

    def watch() -> None:
        while running:
            peak.append(process.memory_info().rss)
            threading.Event().wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        evaluate.run(eval_config(tmp_path / "second.json"))  # the next stage: an engine of its own
    finally:
        running = False
        watcher.join()
    after = process.memory_info().rss
    record_property("figure: RSS around a vLLM-CPU eval stage (2 GiB KV cache)",
                    f"{settled / GiB:.2f} GiB before, {max(peak) / GiB:.2f} during, {after / GiB:.2f} after")
    assert max(peak) - settled > 0.8 * KV_CACHE_GB * GiB  # the engine did hold its cache
    assert after - settled < 0.3 * GiB  # and all of it came back

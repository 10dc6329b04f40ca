"""An engine that a stage opened gives its memory back when the stage ends, as the pipeline needs
between its stages (they run in one process). vLLM's engine core freezes the garbage collector's
view of everything when it starts (vLLM issue #21073): without the stage's `close`, the first
engine of a process stays, all 2.5 GiB of it here."""

from __future__ import annotations

import contextlib
import threading
import weakref

import psutil
import pytest
import torch

from stages import evaluate
from stages.agent.backends import make_backend
from stages.common.config import load_config

GiB = 2**30
KV_CACHE_GB = 2


def eval_config(out):
    return load_config(None, ["rollout.backend=vllm", f"rollout.kv_cache_gb={KV_CACHE_GB}", "rollout.max_turns=1",
                              "rollout.max_new_tokens=8", "eval.seeds=2", "eval.pass_k=1", f"eval.out={out}",
                              "quiet=true"])


@contextlib.contextmanager
def highest_rss(process: psutil.Process):
    """The largest RSS seen, every 0.1 s, while the block runs (appended to the list it gives)."""
    seen, done = [process.memory_info().rss], threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            seen.append(process.memory_info().rss)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the process's RAM: the CPU engine's")
def test_an_engine_closed_between_stages_gives_its_memory_back(tmp_path, monkeypatch, record_property):
    engines = []

    def opening(model_config, rollout, **kwargs):
        backend = make_backend(model_config, rollout, **kwargs)
        engines.append(weakref.ref(backend.llm))
        return backend

    monkeypatch.setattr(evaluate, "make_backend", opening)
    process = psutil.Process()
    start = process.memory_info().rss
    with highest_rss(process) as first_peak:
        evaluate.run(eval_config(tmp_path / "first.json"))  # the first engine of this process
    first = process.memory_info().rss
    with highest_rss(process) as second_peak:
        evaluate.run(eval_config(tmp_path / "second.json"))  # the next stage: an engine of its own
    second = process.memory_info().rss
    record_property("figure: RSS around two vLLM-CPU eval stages (2 GiB KV cache each)",
                    f"{start / GiB:.2f} GiB at first, {max(first_peak) / GiB:.2f} during the first, "
                    f"{first / GiB:.2f} after it, {max(second_peak) / GiB:.2f} during the second, "
                    f"{second / GiB:.2f} after it")
    assert len(engines) == 2 and all(engine() is None for engine in engines)  # nothing of an engine is left
    assert min(max(first_peak) - start, max(second_peak) - first) > 0.8 * KV_CACHE_GB * GiB  # each held its cache
    assert first - start < 1.5 * GiB  # one-off imports and caches (~1 GiB) only: a kept engine adds 2.3 GiB
    assert abs(second - first) < 0.3 * GiB

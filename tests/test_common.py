"""What every stage shares: the console, the "same run?" rule, seeds, and the config's ranges."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
from helpers import FakeClock

from stages.common import console as console_module
from stages.common import rss, runs
from stages.common.config import SPAConfig, load_config
from stages.common.console import Console
from stages.common.errors import UserError
from stages.common.seeds import stable_seed

# ---- console -------------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(console_module.time, "monotonic", fake)
    return fake


def test_without_a_terminal_progress_is_plain_lines_at_most_every_few_seconds(clock, monkeypatch):
    stream = io.StringIO()  # not a terminal
    monkeypatch.setattr(console_module.sys, "stderr", stream)
    with Console().progress("sft", total=4, done=1, unit="steps") as bar:
        clock.now += 30
        bar.update(2, "loss 1.500")  # the first update at once: 30 s for one step, 60 s left for two
        clock.now += 1
        bar.update(3, "loss 1.200")  # within LOG_EVERY_S of the last line: held back
        clock.now += 20
        bar.update(4, "loss 1.000")  # more than LOG_EVERY_S later
        clock.now += 3
        bar.update(4, "loss 0.900")  # held back, then written as the bar closes
    assert stream.getvalue().splitlines() == [
        "sft: 2/4 steps (50%) loss 1.500; 30s elapsed, ETA 1m00s",
        "sft: 4/4 steps (100%) loss 1.000; 51s elapsed, ETA 0s",
        "sft: 4/4 steps (100%) loss 0.900; 54s elapsed, ETA 0s",
    ]


def test_a_held_back_line_is_written_when_the_progress_closes(clock, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(console_module.sys, "stderr", stream)
    with Console().progress("eval", total=10) as bar:
        bar.advance(1, "a")
        clock.now += 2
        bar.advance(1, "b")  # stopped here (an error, an interrupt): the log still says where
    assert stream.getvalue().splitlines() == ["eval: 1/10 (10%) a; 0s elapsed, ETA 0s",
                                              "eval: 2/10 (20%) b; 2s elapsed, ETA 8s"]


def test_a_total_learned_once_the_work_starts_is_shown_from_then_on(clock, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(console_module.sys, "stderr", stream)
    with Console().progress("generate", total=0, unit="turns") as bar:
        bar.update(0, "episodes: 0", total=40)
        clock.now += 12
        bar.update(10, "episodes: 0")
    assert stream.getvalue().splitlines() == ["generate: 0/40 turns (0%) episodes: 0; 0s elapsed",
                                              "generate: 10/40 turns (25%) episodes: 0; 12s elapsed, ETA 36s"]


def test_quiet_shows_no_progress_and_no_status_but_results(capsys, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(console_module.sys, "stderr", stream)
    quiet = Console(quiet=True)
    with quiet.progress("ppo", total=2) as bar:
        bar.update(2, "reward 1.0")
    quiet.say("ppo: starting")
    quiet.result("generate: 4 episodes")
    assert stream.getvalue() == "" and capsys.readouterr().out == "generate: 4 episodes\n"


def test_durations():
    assert [console_module.duration(s) for s in (0, 42.4, 185, 7260)] == ["0s", "42s", "3m05s", "2h01m"]


# ---- peak RSS ------------------------------------------------------------------------------------


def test_the_peak_rss_starts_again_at_each_stage_where_linux_allows(monkeypatch):
    monkeypatch.setattr(rss, "_reset_since_start", False)
    assert rss.peak()["peak_rss_since"] == "process"
    block = b"x" * 300_000_000  # 0.3 GB, every page written: resident, and unmapped when freed
    with_block = rss.peak()["peak_rss_gb"]
    del block
    if not rss.reset_peak():
        pytest.skip("this platform cannot reset the peak (no writable /proc/self/clear_refs)")
    now = rss.current_gb()
    after = rss.peak()
    assert after["peak_rss_since"] == "stage"
    assert now <= after["peak_rss_gb"] <= with_block - 0.25


HEAP_PROBE = """
import ctypes, json, sys
from stages.common import rss

class Glibc234:
    \"\"\"This C library as glibc up to 2.34 answers mallopt: an mmap threshold above HEAP_MAX_SIZE / 2
    (32 MiB on 64-bit) is refused (0) and changes nothing.\"\"\"
    def __init__(self, libc):
        self.libc = libc
    def __getattr__(self, name):
        return getattr(self.libc, name)
    def mallopt(self, param, value):
        return 0 if param == rss._M_MMAP_THRESHOLD and value > 32 << 20 else self.libc.mallopt(param, value)

if sys.argv[1:] == ["2.34"]:
    rss._glibc = lambda libc=Glibc234(rss._glibc()): libc

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
mapped = lambda: libc.mallinfo2().hblkhd  # bytes in blocks that are mappings of their own
block_size = 64 << 20
seen = {"mapped_before": mapped()}
rss.heap_at_steady_state()
block = b"x" * block_size  # every page written
seen["mapped_steady"] = mapped()
del block
with rss.blocks_kept_in_heap() as threshold:
    seen["threshold"] = threshold
    seen["rss_before"] = rss.current_gb()
    block = b"x" * block_size
    seen["mapped_kept"] = mapped()
    del block
    seen["rss_freed_inside"] = rss.current_gb()
rss.return_freed_memory()
seen["rss_returned"] = rss.current_gb()
block = b"x" * block_size
seen["mapped_steady_again"] = mapped()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("glibc", ["here", "2.34"])
def test_generation_keeps_large_blocks_in_the_heap_and_hands_them_back_after(glibc):
    """glibc serves a 64 MiB block from a mapping of its own at the steady threshold (32 MiB), and
    from the heap within `blocks_kept_in_heap`, where its pages stay resident after it is freed;
    `return_freed_memory` hands them back, and after the context the steady threshold holds
    again. Where glibc refuses the generation threshold (up to 2.34, simulated on this glibc: it
    sets what the simulation accepts), the context says it keeps the steady one, under which the
    block is a mapping of its own there too, gone when freed."""
    import ctypes
    import json
    import subprocess

    try:
        has_mallinfo2 = hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        has_mallinfo2 = False
    if not has_mallinfo2:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, glibc], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    seen = json.loads(out.stdout)
    block, block_gb = 64 << 20, (64 << 20) / 1e9
    if glibc == "2.34":
        assert seen["threshold"] == rss.STEADY_MMAP_THRESHOLD
    assert seen["mapped_steady"] - seen["mapped_before"] >= block
    if seen["threshold"] > block:  # from the heap, and still resident once freed
        assert seen["mapped_kept"] == seen["mapped_before"]
        assert seen["rss_freed_inside"] - seen["rss_before"] >= 0.9 * block_gb
    else:  # a mapping of its own, unmapped when freed
        assert seen["mapped_kept"] - seen["mapped_before"] >= block
        assert seen["rss_freed_inside"] - seen["rss_before"] <= 0.1 * block_gb
    assert seen["rss_returned"] - seen["rss_before"] <= 0.1 * block_gb
    assert seen["mapped_steady_again"] - seen["mapped_before"] >= 64 << 20


def test_without_proc_the_peak_is_the_processs(monkeypatch, tmp_path):
    import resource

    monkeypatch.setattr(rss, "_reset_since_start", False)
    monkeypatch.setattr(rss, "CLEAR_REFS", tmp_path / "absent" / "clear_refs")
    monkeypatch.setattr(rss, "STATUS", tmp_path / "absent" / "status")
    assert rss.reset_peak() is False
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert rss.peak() == {"peak_rss_gb": round(lifetime / 1e9, 3), "peak_rss_since": "process"}


# ---- the same run? -------------------------------------------------------------------------------


def test_first_difference_names_the_first_sorted_key_that_differs():
    saved = {"rollout": {"temperature": 1.0, "max_turns": 5}, "model": "a"}
    assert runs.first_difference(saved, saved) is None
    assert runs.first_difference(saved, {**saved, "model": "b"}) == "model: 'a' -> 'b'"
    now = {"rollout": {"temperature": 0.5, "max_turns": 2}, "model": "b"}
    assert runs.first_difference(saved, now) == "model: 'a' -> 'b'"
    now["model"] = "a"
    assert runs.first_difference(saved, now) == "rollout.max_turns: 5 -> 2"
    assert runs.first_difference({"a": 1}, {"a": 1, "b": 2}) == "b: None -> 2"


def test_start_fresh_refused_resumed_or_refused_for_other_settings(tmp_path):
    out = tmp_path / "t.jsonl"
    settings = {"rollout": {"temperature": 1.0}}
    assert runs.start(out, settings, resume=False, what="generate") is False  # nothing there
    assert runs.start(out, settings, resume=True, what="generate") is False  # --resume from the start
    out.write_text("{}\n")
    runs.record(out, "generate", {}, settings)
    with pytest.raises(UserError, match=r"t.jsonl already holds a generate run; add --resume to continue it, "
                                        r"or choose another --out to start fresh$"):
        runs.start(out, settings, resume=False, what="generate")
    assert runs.start(out, settings, resume=True, what="generate") is True
    with pytest.raises(UserError, match=r"it was made with other settings \(rollout.temperature: 1.0 -> 0.5\); "
                                        r"restore them to continue it, or choose another --out to start fresh"):
        runs.start(out, {"rollout": {"temperature": 0.5}}, resume=True, what="generate")
    (tmp_path / "t.jsonl.manifest.json").write_text("{not json")
    with pytest.raises(UserError, match=r"has no readable t.jsonl.manifest.json"):
        runs.start(out, settings, resume=True, what="generate")


# ---- seeds ---------------------------------------------------------------------------------------


def test_stable_seed_is_fixed_and_fits_its_bits():
    assert stable_seed(0, "sokoban-10-0", 1) == stable_seed(0, "sokoban-10-0", 1)
    assert stable_seed(0, "sokoban-10-0", 1) != stable_seed(0, "sokoban-10-0", 2)
    assert stable_seed("a", bits=31) < 2**31 and stable_seed("a") < 2**64
    # the low 31 bits of the 64-bit seed: one hash, two widths
    assert stable_seed("a", bits=31) == stable_seed("a") & (2**31 - 1)
    # pinned: the random backend's actions (RandSFT data) and vLLM's request seeds come from it
    assert stable_seed(7, "x") == 0x9A6A5A0D0E916F6D


# ---- ranges in the schema ------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("sft.lr=.nan", "sft.lr must be a finite number, got nan"),
    ("sft.lr=.inf", "sft.lr must be a finite number, got inf"),
    ("rollout.top_p=7", "rollout.top_p must be > 0 and <= 1, got 7"),
    ("sft.epochs=-2", "sft.epochs must be >= 1, got -2"),
    ("ppo.clip_low=-3", "ppo.clip_low must be > 0 and < 1, got -3"),
    ("ppo.dual_clip=1", "ppo.dual_clip must be > 1, got 1"),
    ("ppo.gamma=1.5", "ppo.gamma must be >= 0 and <= 1, got 1.5"),
    ("rollout.format_penalty=-.inf", "rollout.format_penalty must be a finite number, got -inf"),
    ("sft.betas=[0.9,1.0]", "sft.betas[1] must be >= 0 and < 1, got 1"),
    ("rollout.max_actions_per_traj=0", "rollout.max_actions_per_traj must be >= 1, got 0"),
    ("eval.n=0", "eval.n must be >= 1, got 0"),
    ("pipeline.data_groups=0", "pipeline.data_groups must be >= 1, got 0"),
])
def test_every_number_is_checked_when_the_config_is_built(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert str(err.value) == message


def test_the_issue_example_fails_on_its_first_bad_number():
    with pytest.raises(UserError, match="must be"):
        load_config(None, ["sft.lr=.nan", "rollout.top_p=7", "sft.epochs=-2", "ppo.clip_low=-3"])


def test_null_where_allowed_and_every_default_in_range():
    config = load_config(None, ["rollout.max_actions_per_traj=null", "eval.n=null", "rollout.history_window=0"])
    assert config.rollout.max_actions_per_traj is None and config.eval.n is None
    SPAConfig()  # the defaults pass their own ranges
    assert math.isfinite(SPAConfig().rollout.format_penalty)


# ---- models --------------------------------------------------------------------------------


@pytest.mark.parametrize("device, dtype, capability, installed, expected", [
    ("cpu", "bfloat16", None, True, "sdpa"),
    ("cuda", "float32", (9, 0), True, "sdpa"),  # flash-attention has no fp32 kernel
    ("cuda", "bfloat16", (8, 0), True, "flash_attention_2"),
    ("cuda:1", "float16", (9, 0), True, "flash_attention_2"),
    ("cuda", "bfloat16", (7, 5), True, "sdpa"),  # before Ampere
    ("cuda", "bfloat16", (9, 0), False, "sdpa"),  # flash-attn not installed
])
def test_flash_attention_only_where_it_can_run(monkeypatch, device, dtype, capability, installed, expected):
    import torch
    import transformers.utils

    from stages.common.models import pick_attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: installed)
    assert pick_attention("auto", device, getattr(torch, dtype)) == expected
    assert pick_attention("eager", device, getattr(torch, dtype)) == "eager"  # an explicit choice stands


def test_ordinary_tests_see_no_gpu():
    """conftest hides the GPUs from runs that do not select the GPU tests: `model.device: auto` is the CPU."""
    import os

    import torch

    from stages.common.models import pick_device

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available() and pick_device() == "cpu"

"""`make gpu-check` (bench/gpu_check.py) on the CPU: without CUDA it refuses in one line; with
``--device cpu --tiny`` every stage runs on a 2-layer Qwen2 built from the shipped config.json,
and the JSON holds what a GPU run would report, the memory as the CPU's peak RSS. The GPU's use is
polled through NVML (faked here), never with a CUDA call, and vLLM is told to send no usage stats."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
GIB = 2**30


def gpu_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=NO_GPU, capture_output=True, text=True,
                          timeout=1200, check=False)


def test_without_cuda_the_check_refuses_in_one_line(tmp_path):
    result = gpu_check(cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: the GPU check needs a CUDA GPU")
    assert "--device cpu --tiny" in result.stderr
    unknown = gpu_check("--device", "cpu", "--only", "sft_zero4", cwd=tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: --only names no stage sft_zero4;")


def test_every_stage_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    result = gpu_check("--device", "cpu", "--tiny", "--work", str(tmp_path / "work"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["machine"]["device"] == "cpu" and report["model"] == "Qwen/Qwen2.5-1.5B-Instruct (tiny)"
    stages = report["stages"]
    assert list(stages) == ["generate_hf", "generate_vllm", "sft_zero2", "sft_zero3", "ppo", "eval"]
    with_vllm = importlib.util.find_spec("vllm") is not None
    if not with_vllm:
        assert stages.pop("generate_vllm") == {"ok": False, "skipped": "vLLM is not installed"}
    assert all(stage["ok"] and stage["seconds"] > 0 and stage["memory"]["peak_rss_gib"] > 0
               for stage in stages.values()), stages
    assert stages["ppo"]["backend"] == stages["eval"]["backend"] == ("vllm" if with_vllm else "hf")
    assert stages["generate_hf"]["episodes"] == 4 and stages["generate_hf"]["tokens_per_s"] > 0
    assert stages["sft_zero2"]["steps"] == stages["sft_zero3"]["steps"] == 2
    assert "backend" not in stages["sft_zero2"] and "backend" not in stages["sft_zero3"]
    assert stages["ppo"]["steps"] == 2 and all(diff < 1e-3 for diff in stages["ppo"]["logp_diff"])
    for name, stage in stages.items():  # spa plan's prediction beside each
        assert stage["plan"]["total_gib"] > 0 and stage["plan"]["fits"], name
    assert 0 <= stages["eval"]["pass@1"] <= 1


@pytest.fixture
def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda's calls that PeakMemory makes, on a GPU of 80 GiB; `mem_get_info`, a CUDA call
    that can break the graph capture vLLM runs meanwhile, fails the test."""
    for name in ("set_device", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: pytest.fail("mem_get_info was called"))



def test_the_gpus_use_is_polled_through_nvml(gpu_check_module, fake_gpu, monkeypatch):
    readings, all_read = [10 * GIB, 30 * GIB, 50 * GIB, 20 * GIB], threading.Event()  # vLLM comes and goes

    def used(index):
        if len(readings) == 1:
            all_read.set()
        return readings.pop(0) if len(readings) > 1 else readings[0]

    monkeypatch.setattr(torch.cuda, "device_memory_used", used)
    with gpu_check_module.PeakMemory("cuda") as peak:
        assert all_read.wait(timeout=10)
    assert peak.figures() == {"max_memory_allocated_gib": 5.0, "total_gib": 80.0, "used_at_start_gib": 10.0,
                              "peak_used_gib": 50.0}


def test_without_nvml_the_gpus_use_is_null_and_says_why(gpu_check_module, fake_gpu, monkeypatch, capsys):
    def no_nvml(index):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    with gpu_check_module.PeakMemory("cuda") as peak:
        pass
    reason = ("NVML cannot be read (nvidia-ml-py does not seem to be installed or it can't be imported.); "
              "pip install nvidia-ml-py")
    assert peak.figures() == {"max_memory_allocated_gib": 5.0, "total_gib": 80.0, "used_at_start_gib": None,
                              "peak_used_gib": None, "not_polled": reason}
    assert capsys.readouterr().err == f"gpu-check: the GPU's use is not polled: {reason}\n"


def test_the_check_sends_vllm_no_usage_statistics(tmp_path):
    code = (f"import os, runpy, sys; sys.argv = [{str(SCRIPT)!r}, '--help']\n"
            f"try: runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('VLLM_NO_USAGE_STATS', os.environ.get('VLLM_NO_USAGE_STATS'), file=sys.stderr)")
    env = {key: value for key, value in NO_GPU.items() if key != "VLLM_NO_USAGE_STATS"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stderr.splitlines()[-1] == "VLLM_NO_USAGE_STATS 1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_check_runs_on_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "work")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=3600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    stages = json.loads(result.stdout)["stages"]
    ran = [stage for stage in stages.values() if not stage.get("skipped")]
    assert all(stage["ok"] and stage["memory"]["max_memory_allocated_gib"] > 0 and stage["plan"]["fits"]
               for stage in ran), stages

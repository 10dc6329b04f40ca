"""Fixtures of the vLLM tests. These files run in pytest processes of their own (tests/test_vllm.py
starts them), so an engine can serve every test of a file: vLLM takes 15-45 s to start on a CPU."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_device():
    """The device vLLM runs on here; the tests skip where it finds none (CUDA vLLM in a run that
    hides the GPUs)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    pytest.skip("vLLM finds no device: a CUDA build of vLLM with the GPUs hidden (run the GPU tests: pytest -m gpu)")


def lively_model(tokenizer, seed: int = 0):
    """A 2-layer random Llama that vLLM's CPU kernels take (head size 64; they have no kernel for
    the suite's usual tiny model's 16), with weights large enough that its greedy text depends on
    the context."""
    from helpers import lively_model as lively

    return lively(tokenizer, seed=seed, hidden=128, heads=2)


@pytest.fixture(scope="session")
def vllm_tiny_dir(tmp_path_factory, tokenizer):
    """`lively_model` saved as a Hugging Face directory, with the bundled tokenizer."""
    from helpers import model_dir

    return model_dir(lively_model(tokenizer), tokenizer, tmp_path_factory.mktemp("vllm-tiny"))

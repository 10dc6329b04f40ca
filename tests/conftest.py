"""Shared fixtures. Nothing here reaches a model hub: the tokenizer is the bundled SmolLM2's and
test models are tiny random Llamas built locally."""

import os

import pytest

from stages.common.models import CPU_DTYPE_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
#: `model.dtype: auto` on a CPU is whatever a matmul probe finds faster on the machine; the tests
#: that compare numbers across passes and processes (PPO's log-prob agreement, resumes, ranks)
#: are written for fp32, so auto means fp32 here on every machine: in this process, in its
#: module-scoped fixtures and in every process it starts. The probe's own tests unset it.
os.environ[CPU_DTYPE_ENV] = "float32"

#: tests/vllm_engine/ (not tests/vllm/, which would import as `vllm` where vLLM is not installed) runs in
#: pytest processes of its own (tests/test_vllm.py starts them, with this set):
#: an in-process vLLM engine changes process-wide state that the other tests must not see.
VLLM_CHILD = "SPA_VLLM_TESTS"
collect_ignore = [] if os.environ.get(VLLM_CHILD) else ["vllm_engine"]


def pytest_configure(config):
    """The ordinary tests run on the CPU, GPU or not (`model.device: auto` would put them on CUDA,
    where their CPU tolerances and CPU-only engines do not hold): GPUs stay visible only to a run
    that selects the GPU tests (`pytest -m gpu`). Set before torch first looks for CUDA, and
    inherited by the processes the tests start."""
    markexpr = config.getoption("markexpr", "") or ""
    if "gpu" not in markexpr.replace("not gpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True)
def unpinned_dtype_for_the_probe_tests(request, monkeypatch):
    """Tests marked `real_dtype_probe` (the probe's own) see the probe, not the pinned fp32."""
    if "real_dtype_probe" in request.keywords:
        monkeypatch.delenv(CPU_DTYPE_ENV)


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled SmolLM2-135M-Instruct tokenizer (converted once into the cache, ~30 s)."""
    from stages.common.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A 2-layer random Llama with the bundled tokenizer, saved as a Hugging Face directory."""
    from helpers import model_dir, tiny_model

    return model_dir(tiny_model(tokenizer), tokenizer, tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def answering_dir(tokenizer, tmp_path_factory):
    """`helpers.answering_model` saved as a Hugging Face directory: a tiny model whose FrozenLake
    episodes earn different scores."""
    from helpers import answering_model, model_dir

    return model_dir(answering_model(tokenizer), tokenizer, tmp_path_factory.mktemp("answering-model"))


def pytest_terminal_summary(terminalreporter):
    """How many bad-input cases and fuzz inputs the run tried, and the figures tests measured (tests
    record them as properties, which reach the controller under xdist too)."""
    totals: dict[str, int] = {}
    figures: list[str] = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == "bad_input_case":
                    totals["bad-input cases"] = totals.get("bad-input cases", 0) + 1
                elif name == "fuzz_inputs":
                    totals["fuzz inputs"] = totals.get("fuzz inputs", 0) + value
                elif name.startswith("figure: "):
                    figures.append(f"{name.removeprefix('figure: ')} = {value}")
    if totals:
        terminalreporter.write_line("tried: " + ", ".join(f"{count} {what}" for what, count in totals.items()))
    for figure in figures:
        terminalreporter.write_line(f"measured: {figure}")

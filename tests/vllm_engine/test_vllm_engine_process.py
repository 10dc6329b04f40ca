"""The vLLM engine in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the user's
choice): the trainer's weights reach it in messages of bounded size, staged there until the last,
and it then samples the new weights. A file of its own: the setting is read when vLLM starts."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import lively_model
from test_vllm_ppo import GREEDY, assert_samples, requests

from stages.agent.backends import vllm as vllm_backend
from stages.agent.backends.vllm import VLLMBackend


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant")
def test_weights_pushed_in_parts_to_an_engine_process_are_sampled(vllm_tiny_dir, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    backend = VLLMBackend(str(vllm_tiny_dir), tokenizer, dtype="float32", batch_size=4)
    assert not backend.in_process
    updated = lively_model(tokenizer, seed=1)
    sizes = []
    original = backend.llm.collective_rpc

    def recording(method, args=()):
        if method == "spa_stage_weights":
            part = torch.load(io.BytesIO(args[0]), weights_only=True)
            sizes.append(sum(tensor.numel() * tensor.element_size() for _, tensor in part))
        return original(method, args=args)

    monkeypatch.setattr(backend.llm, "collective_rpc", recording)
    monkeypatch.setattr(vllm_backend, "PUSH_CHUNK_BYTES", 2**17)  # parts of 128 KiB, or one larger tensor
    backend.load_weights(updated.named_parameters())
    largest = max(p.numel() * p.element_size() for p in updated.parameters())
    assert len(sizes) > 2 and max(sizes) <= max(2**17, largest)
    assert_samples(updated, tokenizer, backend.generate(requests(), GREEDY))
    backend.close()

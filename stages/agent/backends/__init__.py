"""Generation backends, and `make_backend`, the one way every stage opens one.

* ``hf``: transformers on CPU or GPU, with KV reuse across turns (`stages.agent.backends.hf`);
* ``vllm``: vLLM (`stages.agent.backends.vllm`);
* ``random``: the paper's random-action baseline, no model (`stages.agent.backends.random`).

Every backend has a ``name``, a ``tokenizer`` (None for the text-only random backend) and a
``model`` (the HF model the hf backend generates with; None for the others). Backends are imported
lazily: `random` needs no torch, `vllm` is an optional dependency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.agent.backends.base import (
    Completion,
    GenerationBackend,
    GenerationRequest,
    SamplingParams,
    end_token_ids,
)

if TYPE_CHECKING:
    from stages.common.config import ModelConfig, RolloutConfig

__all__ = ["BACKENDS", "Completion", "GenerationBackend", "GenerationRequest", "SamplingParams", "end_token_ids",
           "make_backend"]

BACKENDS = ("hf", "vllm", "random")


def make_backend(model_config: ModelConfig, rollout: RolloutConfig, *, model=None, tokenizer=None) -> GenerationBackend:
    """The backend `rollout.backend` names, for the model `model_config` names.

    hf: generates with `model`/`tokenizer` when given (PPO passes its live actor, so rollouts use
    the current weights), else loads them. vllm: loads the model into a vLLM engine (`tokenizer`,
    if given, is used for the end-of-turn tokens). random: needs neither. A bad model name fails
    here, in one line, before anything loads.
    """
    kind = rollout.backend
    if kind == "random":
        from stages.agent.backends.random import RandomBackend

        return RandomBackend(rollout.prompt_mode, rollout.sample_seed, tuple(rollout.random_actions))
    from stages.common.models import load_model, load_tokenizer, resolve_model

    path = resolve_model(model_config.name)
    if kind == "hf":
        from stages.agent.backends.hf import HFBackend

        if model is None:
            model, loaded = load_model(model_config)
            tokenizer = tokenizer if tokenizer is not None else loaded
        elif tokenizer is None:
            tokenizer = load_tokenizer(model_config.name, model_config.trust_remote_code)
        return HFBackend(model, tokenizer, batch_size=rollout.batch_size)
    from stages.agent.backends.vllm import VLLMBackend

    return VLLMBackend(path, tokenizer, dtype=model_config.dtype,
                       gpu_memory_utilization=rollout.gpu_memory_utilization, seed=rollout.sample_seed,
                       trust_remote_code=model_config.trust_remote_code)

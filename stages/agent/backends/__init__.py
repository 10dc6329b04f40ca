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
    OnProgress,
    SamplingParams,
    end_token_ids,
)
from stages.common.errors import UserError

if TYPE_CHECKING:
    from stages.common.config import ModelConfig, RolloutConfig

__all__ = ["BACKENDS", "Completion", "GenerationBackend", "GenerationRequest", "OnProgress", "SamplingParams",
           "check_backend", "end_token_ids", "make_backend"]

BACKENDS = ("hf", "vllm", "random")


def make_backend(model_config: ModelConfig, rollout: RolloutConfig, *, prompt_mode: str, model=None,
                 tokenizer=None, colocated: bool = False) -> GenerationBackend:
    """The backend `rollout.backend` names, for the model `model_config` names, to play with the
    `prompt_mode` prompt (which the random backend writes its responses in).

    hf: generates with `model`/`tokenizer` when given (PPO passes its live actor, so rollouts use
    the current weights), else loads them. vllm: loads the model into a vLLM engine (`tokenizer`,
    if given, is used for the end-of-turn tokens); `colocated` (PPO) says that it shares the
    device with a trainer: on a GPU it then sleeps during each update (`sleep`), its memory handed
    to training, and wakes with the new weights. random: needs neither. A bad model name fails
    here, in one line, before anything loads. Whoever opens a backend closes it (`close`) when
    done with it.
    """
    kind = rollout.backend
    if kind not in BACKENDS:
        raise UserError(f"rollout.backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    if kind == "random":
        from stages.agent.backends.random import RandomBackend

        return RandomBackend(prompt_mode, rollout.sample_seed, tuple(rollout.random_actions),
                            name_actions=rollout.random_reasoning == "actions",
                            effective_only=rollout.random_moves == "effective")
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

    return VLLMBackend(path, tokenizer, dtype=model_config.dtype, kv_cache_gb=rollout.kv_cache_gb,
                       gpu_memory_utilization=rollout.gpu_memory_utilization, batch_size=rollout.batch_size,
                       seed=rollout.sample_seed, trust_remote_code=model_config.trust_remote_code,
                       sleep_mode=colocated)


def backend_device(model_config: ModelConfig, rollout: RolloutConfig) -> str:
    """Where the backend `rollout.backend` runs (the random backend needs no model: the CPU)."""
    from stages.common.models import pick_device

    return "cpu" if rollout.backend == "random" else pick_device(model_config.device)


def describe_player(model_config: ModelConfig, rollout: RolloutConfig, world: int = 1,
                    backend: GenerationBackend | None = None) -> str:
    """What plays, for a stage's header line: the backend a caller passed in, or else what
    `make_backend` will open, told before it loads anything: "model smollm2-135m, hf backend on
    cpu (float32)" (the device and dtype it will pick), with "x N ranks" under a launcher; "random
    actions, no model" for the random backend."""
    if backend is not None:
        return f"{backend.name} backend"
    if rollout.backend == "random":
        return "random actions, no model"
    ranks = f" x {world} ranks" if world > 1 else ""
    return (f"model {model_config.name}, {rollout.backend} backend on {backend_device(model_config, rollout)}"
            f"{ranks} ({backend_dtype(model_config, rollout)})")


def backend_dtype(model_config: ModelConfig, rollout: RolloutConfig) -> str | None:
    """The dtype the model `make_backend` opens computes in ("float32", "bfloat16", ...), or None for
    the random backend, which has no model."""
    if rollout.backend == "random":
        return None
    from stages.common.models import pick_dtype

    return str(pick_dtype(model_config.dtype, backend_device(model_config, rollout))).removeprefix("torch.")


def check_backend(model_config: ModelConfig, rollout: RolloutConfig) -> None:
    """Refuse, before anything is loaded or written, what would stop `make_backend` later: for
    vllm, vLLM missing, no device it runs on, an architecture it lacks, or memory the machine does
    not have (`stages.agent.backends.vllm.plan_engine`). Stages that open their backend late (ppo,
    pipeline) call it first."""
    if rollout.backend != "vllm":
        return
    from stages.agent.backends.vllm import plan_engine
    from stages.common.models import resolve_model

    plan_engine(resolve_model(model_config.name), model_config.dtype, rollout.kv_cache_gb,
                rollout.gpu_memory_utilization, rollout.batch_size, model_config.trust_remote_code)

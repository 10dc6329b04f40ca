"""One setup of a trainable model and its engine, for `spa sft` and `spa ppo` alike.

    config = with_engine_stage(config, "sft")  # zero_stage "auto" resolved for this machine and launch
    dist = start_processes(config.model, zero_stage, to_dict(config))  # device, process group
    model, tokenizer, mixed = load_trainable(config.model, dist, ...)  # dtype, seed, checkpointing, LoRA
    engine = make_engine(model, dist, mixed, zero_stage, optim)         # DeepSpeed ZeRO or plain torch

Precision: `model.dtype` bfloat16 (or float16) trains in mixed precision. DeepSpeed on CUDA takes
the model in that dtype and keeps fp32 master copies itself; every other engine (plain torch, and
DeepSpeed on the CPU) trains fp32 weights under `torch.autocast` (`stages.training.engine`).
float16 needs loss scaling, which only DeepSpeed on CUDA does, so elsewhere it is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.common.distributed import Dist, launched_world
from stages.common.errors import UserError
from stages.common.models import load_model, pick_device, pick_dtype
from stages.training import engine as eng
from stages.training.checkpoints import is_peft

if TYPE_CHECKING:
    from stages.common.config import ModelConfig, SPAConfig, TrainingConfig


def with_engine_stage(config: SPAConfig, kind: str) -> SPAConfig:
    """`config` with ``<kind>.zero_stage`` ("sft" or "ppo") as this launch trains it ("auto" resolved
    by `TrainingConfig.engine_stage` for this device and the launcher's process count), so the run's
    recorded settings, and a resume's check of them, name the engine."""
    section = getattr(config, kind)
    chosen = section.engine_stage(pick_device(config.model.device).startswith("cuda"), launched_world())
    return dataclasses.replace(config, **{kind: dataclasses.replace(section, zero_stage=chosen)})


def start_processes(model: ModelConfig, zero_stage: int, config: dict[str, Any] | None = None) -> Dist:
    """This process's device and, under DeepSpeed, the process group, which every rank joins with
    the same `config` (the stage's whole config; see `engine.setup_distributed`)."""
    return eng.setup_distributed(pick_device(model.device), use_deepspeed=zero_stage > 0, config=config)


def mixed_precision(model: ModelConfig, device: str) -> str | None:
    """"bf16", "fp16" or None (fp32), from `model.dtype` on `device`."""
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(pick_dtype(model.dtype, device))


def precision_label(model: ModelConfig, device: str) -> str:
    """How training on `device` computes, for a stage's header line: "fp32" or "bf16 mixed"."""
    mixed = mixed_precision(model, device)
    return f"{mixed} mixed" if mixed else "fp32"


def load_trainable(model: ModelConfig, dist: Dist, *, zero_stage: int, seed: int,
                   gradient_checkpointing: bool = False, lora_rank: int = 0, lora_alpha: int = 64,
                   without_dropout: bool = False) -> tuple[Any, Any, str | None]:
    """The model to train, its tokenizer and its mixed precision ("bf16", "fp16" or None).

    The weights are loaded after `torch.manual_seed(seed)` (a LoRA adapter or a new head starts the
    same on every run) in the engine's master dtype; the KV cache is off (training passes whole
    sequences); `gradient_checkpointing` recomputes activations in the backward pass (non-reentrant,
    which works with frozen inputs and LoRA); `lora_rank` > 0 wraps all linear layers in LoRA
    adapters (peft); `without_dropout` sets every dropout to 0 (PPO compares log-probs of two passes).
    """
    import torch

    mixed = mixed_precision(model, dist.device)
    if mixed == "fp16" and (zero_stage == 0 or not dist.device.startswith("cuda")):
        raise UserError("float16 training needs loss scaling, which only DeepSpeed on CUDA does: use bfloat16, "
                        "or zero_stage 1-3 on a GPU")
    torch.manual_seed(seed)
    lm, tokenizer = load_model(model, device=dist.device, dtype=eng.master_dtype(mixed, zero_stage, dist.device))
    lm.config.use_cache = False
    if without_dropout:
        disable_dropout(lm)
    if gradient_checkpointing:
        enable_checkpointing(lm)
    if lora_rank > 0:
        lm = add_lora(lm, lora_rank, lora_alpha)
    return lm, tokenizer, mixed


def make_engine(module, dist: Dist, mixed: str | None, zero_stage: int, optim: eng.OptimSettings,
                offload: bool = False, deepspeed_config: str = "", out: Path | None = None):
    """The training engine of `module`: DeepSpeed ZeRO `zero_stage` (1-3), or plain torch (0).
    `offload` keeps the optimizer state off the device that computes: on CUDA in CPU memory; on a
    CPU, with plain torch, in a file in the stage's output directory `out` between steps (DeepSpeed
    on a CPU ignores it)."""
    cuda = dist.device.startswith("cuda")
    to_disk = offload and not cuda and zero_stage == 0
    return eng.build_engine(module, optim, dist, zero_stage, offload and cuda, mixed, deepspeed_config,
                            offload_dir=out if to_disk else None)


def describe_engine(training: TrainingConfig, device: str) -> str:
    """The engine a stage trains with, for its opening line: "ZeRO-2", "plain torch", and what
    `offload` does when a CPU run asks for it."""
    engine = f"ZeRO-{training.zero_stage}" if training.zero_stage else "plain torch"
    if training.offload and device == "cpu":
        engine += " (offload has no effect under DeepSpeed on a CPU)" if training.zero_stage else ", optimizer state on disk"
    return engine


def enable_checkpointing(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def add_lora(model, rank: int, alpha: int):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("LoRA needs peft: pip install 'spa[lora]'") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def inner_lm(model):
    """The transformers model inside a peft wrapper (its LoRA layers sit in it), or `model` itself:
    what forward passes and generation call directly."""
    return model.get_base_model() if is_peft(model) else model


def disable_dropout(model) -> None:
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)

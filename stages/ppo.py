"""`spa ppo`: multi-turn PPO with a critic, on the same rollout engine as `spa generate`.

One step of the loop (SPA's PPO stage, on RAGEN's trainer; the maths is in `stages.training.ppo_algos`,
the samples in `stages.training.ppo_samples`, the networks in `stages.training.policy`):

1. **Rollout**: ``rollout.groups x rollout.group_size`` episodes on fresh train seeds (the seed
   counter starts at ``rollout.seed`` and advances by ``groups`` every step), played by the live
   actor: the hf backend generates with the actor model itself; the vllm backend gets the actor's
   weights after every update. An episode's score (the sum of its turn rewards and format
   penalties) is the reward of its last sampled token.
2. **Filter**: keep the ``ppo.filter_ratio`` of groups with the largest reward std (SPA: 8 of 32).
3. **Old log-probs and values**: a no-grad pass of the actor (and of the frozen reference when
   ``ppo.kl_coef > 0``) and of the critic over the kept episodes. The mean |logp_trainer -
   logp_sampler| over sampled tokens is logged every step (``logp_diff``): it shows that the
   rollouts ran the current weights (it jumps when a weight sync fails).
4. **Advantages**: token-level GAE (gamma = lambda = 1 by default, so A_t = R - V_t) whitened over
   the batch; or the bi-level (turn-level) GAE; or GRPO's group-normalised score, without a critic.
5. **Update**: ``ppo.ppo_epochs`` passes over mini-batches of ``ppo.mini_batch`` episodes, in
   order, one optimizer step per mini-batch for actor and critic (`stages.training.trainable`:
   DeepSpeed ZeRO, or plain torch with ``zero_stage: 0``; AdamW, constant lr, gradient clipping). Micro-batches
   hold at most ``ppo.micro_batch_tokens`` padded tokens and accumulate gradients; every loss is a
   token mean over the whole mini-batch, so the micro-batching never changes the objective.

Token-in/token-out: the sequences trained are the exact token ids the sampler consumed and
produced (`Episode.token_ids`), never re-tokenized text. The loss mask (``ppo.loss_mask``) is the
sampled tokens ("assistant", the paper) or every token after the system prompt ("all", SPA's
released config). Only masked positions are PPO steps, and the actor's and critic's heads run at
those positions only, so prompt and environment tokens cost no vocabulary projection.

Outputs in ``ppo.out``, the run directory of `stages.training.checkpoints`: ``metrics.jsonl`` (one
line per step; step 0 holds the validation before training), ``step-N/`` every ``ppo.save_every``
steps and ``final/`` (Hugging Face directories of the actor with its tokenizer),
``val/step-N.json`` (`spa eval` reports with their trajectories, every ``ppo.val_every`` steps,
before training and at the end), ``manifest.json``, and ``trainer_state/`` for ``--resume`` (actor
and critic engines with their optimizers, the step, the seed counter and the RNG state), written
with each checkpoint.

Simplifications compared with verl/RAGEN (SPA's trainer), nanochat style:

* One process: rollout and training share the actor; no Ray, no resharding, no multi-GPU PPO.
* The KL term, when on, is a loss term (``kl_coef`` x the k3 estimator, verl's ``use_kl_loss``),
  not a reward penalty; SPA has it off.
* Dropout is switched off in actor and critic, so old and new log-probs are comparable.
* ZeRO-3 and float16 are refused: the hf backend generates with the live, unsharded actor, and
  loss scaling is not worth it when bf16 exists.
* The critic is the same network (a copy of the same checkpoint) with its LM head replaced by a
  linear value head, zero-initialised so that the first values are 0.
* Each step's rollouts start with empty KV caches, so a resumed run samples exactly what an
  uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages.agent.backends import make_backend
from stages.agent.env_manager import make_env
from stages.agent.proxy import play
from stages.common import artifacts
from stages.common.config import SPAConfig, to_dict
from stages.common.console import Console
from stages.common.errors import UserError
from stages.common.seeds import stable_seed
from stages.training import engine as eng
from stages.training import ppo_algos as algos
from stages.training import trainable
from stages.training.checkpoints import FINAL_DIR, RunDir, save_hf_checkpoint
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import (
    Sample,
    collate,
    compute_advantages,
    flat,
    micro_batches,
    padded,
    score,
    step_mask,
    system_prompt_length,
    to_sample,
)

#: `stages.training.engine` schedules are cosine; over 2**62 steps the factor is exactly 1.0 (in float64)
#: for any run that will ever happen, which is PPO's constant learning rate.
CONSTANT_LR_STEPS = 2**62
#: AdamW betas of verl's actor and critic (SPA sets none).
ADAM_BETAS = (0.9, 0.999)
#: Settings that may differ between a run and its --resume without changing what is computed.
RESUME_FREE = {"out", "resume", "steps", "val_every", "save_every", "micro_batch_tokens", "gradient_checkpointing",
               "pack_groups"}


# ---- configuration checks ------------------------------------------------------------------------


def check_config(config: SPAConfig) -> None:
    """Refuse settings PPO cannot run with, each with one line that names the numbers."""
    ppo, rollout = config.ppo, config.rollout
    make_env(config.env)  # its name and options
    if rollout.backend not in ("hf", "vllm"):
        raise UserError(f"ppo needs a model backend: rollout.backend must be hf or vllm, got {rollout.backend!r}")
    if rollout.history_window is not None:
        raise UserError("ppo trains on each episode as one token sequence; set rollout.history_window=null")
    if rollout.temperature <= 0:
        raise UserError(f"ppo samples its rollouts: rollout.temperature must be > 0, got {rollout.temperature}")
    if ppo.zero_stage == 3:
        raise UserError("ppo.zero_stage=3 is not supported (the rollouts use the live, unsharded actor); use 0-2")
    if config.model.dtype == "float16":
        raise UserError("ppo trains in float32 or bfloat16; set model.dtype to auto, float32 or bfloat16")
    if ppo.old_logprobs == "sampler" and (ppo.loss_mask != "assistant" or rollout.top_p < 1
                                          or config.model.dtype not in ("float32", "auto")):
        raise UserError("ppo.old_logprobs=sampler needs ppo.loss_mask=assistant (environment tokens have no "
                        "sampler log-prob), rollout.top_p=1 (the trainer scores the whole vocabulary) and fp32 "
                        "(in bf16 sampler and trainer round differently); or use ppo.old_logprobs=trainer")
    if ppo.advantage == "grpo" and rollout.group_size < 2:
        raise UserError("ppo.advantage=grpo compares episodes within a group: rollout.group_size must be >= 2")
    kept_groups = algos.groups_to_keep(rollout.groups, ppo.filter_ratio)
    kept = kept_groups * rollout.group_size
    if kept % ppo.mini_batch:
        raise UserError(
            f"ppo.mini_batch={ppo.mini_batch} does not divide the episodes kept per step: "
            f"rollout.groups={rollout.groups} x ppo.filter_ratio={ppo.filter_ratio} -> {kept_groups} groups "
            f"x rollout.group_size={rollout.group_size} = {kept}; pick a mini_batch that divides {kept}")


def settings(config: SPAConfig) -> dict[str, Any]:
    """What decides the trained model: model, game, rollouts and PPO settings (but RESUME_FREE)."""
    data = to_dict(config)
    ppo = {k: v for k, v in data["ppo"].items() if k not in RESUME_FREE}
    return {"model": data["model"], "env": data["env"], "rollout": data["rollout"], "ppo": ppo}


# ---- models --------------------------------------------------------------------------------------


@dataclass
class Models:
    actor: nn.Module  # the HF causal LM that the hf backend generates with
    tokenizer: Any
    actor_engine: Any  # trains StepPolicy(actor)
    critic_engine: Any | None  # trains ValueModel; None for GRPO
    reference: StepPolicy | None  # frozen copy of the initial actor; None without a KL term
    dist: eng.Dist
    pack: bool  # a group's episodes in one packed sequence (ppo.pack_groups, where the attention allows)


def build_models(config: SPAConfig) -> Models:
    """The checkpoint as actor, critic (a copy with a value head) and optional reference, actor and
    critic in training engines (`stages.training.trainable`)."""
    from stages.common.models import resolve_model

    m, ppo = config.model, config.ppo
    resolve_model(m.name)  # a bad --model fails here, before DeepSpeed starts
    dist = trainable.start_processes(m, ppo.zero_stage, ppo.gradient_checkpointing)
    actor, tokenizer, mixed = trainable.load_trainable(m, dist, zero_stage=ppo.zero_stage, seed=ppo.seed,
                                                       gradient_checkpointing=ppo.gradient_checkpointing,
                                                       without_dropout=True)
    critic = ValueModel(copy.deepcopy(actor)) if ppo.advantage != "grpo" else None
    reference = None
    if ppo.kl_coef > 0:
        reference = StepPolicy(copy.deepcopy(actor).eval().requires_grad_(False), config.rollout.temperature)

    def engine(module: nn.Module, lr: float):
        optim = eng.OptimSettings(lr, ADAM_BETAS, ppo.weight_decay, ppo.grad_clip, CONSTANT_LR_STEPS, 0.0)
        return trainable.make_engine(module, dist, mixed, ppo.zero_stage, optim)

    actor_engine = engine(StepPolicy(actor, config.rollout.temperature), ppo.actor_lr)
    critic_engine = engine(critic, ppo.critic_lr) if critic is not None else None
    # flash-attention 2 takes no 4D mask: packed rows need SDPA or eager attention
    pack = ppo.pack_groups and actor.config._attn_implementation in ("sdpa", "eager")
    return Models(actor, tokenizer, actor_engine, critic_engine, reference, dist, pack)


def _autocast(engine: Any):
    """The engine's autocast (fp32 weights computing in bf16, see `stages.training.engine`), for
    passes made outside it: the reference's scores and the rollouts, in the actor's precision."""
    return eng.autocast(engine.device, engine.autocast_dtype)


# ---- the update ----------------------------------------------------------------------------------


class NonFiniteLoss(UserError):
    """A loss or gradient became NaN or infinite; training stops and keeps the last good checkpoint."""


def update(models: Models, samples: list[Sample], config: SPAConfig, step: int) -> dict[str, float]:
    """``ppo_epochs`` passes of mini-batch updates; returns token-weighted means of the loss terms
    and the mean gradient norms."""
    ppo = config.ppo
    pad_id = models.tokenizer.pad_token_id
    engines = {"actor": models.actor_engine, "critic": models.critic_engine}
    engines = {name: engine for name, engine in engines.items() if engine is not None}
    for engine in engines.values():
        engine.module.train()
    totals: dict[str, float] = {}
    norms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ppo.ppo_epochs):
        for start in range(0, len(samples), ppo.mini_batch):  # in order: SPA's shuffle=False
            mini = samples[start:start + ppo.mini_batch]
            tokens = sum(s.steps for s in mini)  # every loss is a token mean over the mini-batch
            micros = micro_batches(mini, ppo.micro_batch_tokens, models.pack)
            for index, rows in enumerate(micros):
                batch = collate(rows, models.dist.device, pad_id)
                micro = [sample for row in rows for sample in row]  # collate's order
                last = index == len(micros) - 1
                terms = _actor_backward(models, batch, micro, tokens, last, config, step)
                if models.critic_engine is not None:
                    terms |= _critic_backward(models.critic_engine, batch, micro, tokens, last, config, step)
                for key, value in terms.items():  # micro means, weighted by their tokens
                    totals[key] = totals.get(key, 0.0) + value * sum(s.steps for s in micro)
            for name, engine in engines.items():
                norms[name].append(_step(engine, name, step))
    seen = ppo.ppo_epochs * sum(s.steps for s in samples)
    stats = {key: value / seen for key, value in totals.items()}
    return stats | {f"{name}_grad_norm": sum(values) / len(values) for name, values in norms.items()}


def _actor_backward(models: Models, batch: dict, micro: list[Sample], tokens: int, last: bool,
                    config: SPAConfig, step: int) -> dict[str, float]:
    ppo, device = config.ppo, models.dist.device
    logprobs, entropy = models.actor_engine(**batch, with_entropy=True)
    pg_loss, stats = algos.policy_loss(logprobs, flat(micro, "old_logprobs", device), flat(micro, "advantages", device),
                                       torch.ones_like(logprobs), ppo.clip_low, ppo.clip_high, ppo.dual_clip,
                                       normalizer=tokens)
    loss = pg_loss - ppo.entropy_coef * entropy.sum() / tokens
    terms = {"pg_loss": pg_loss.item() * tokens / len(logprobs), "entropy": entropy.mean().item(),
             **{key: value.item() for key, value in stats.items()}}
    if ppo.kl_coef > 0:
        kl = algos.kl_penalty(logprobs, flat(micro, "ref_logprobs", device), "k3")
        loss = loss + ppo.kl_coef * kl.sum() / tokens
        terms["kl_ref"] = kl.mean().item()
    _check_finite(loss, "policy loss", step, config)
    models.actor_engine.backward(loss, last)
    return terms


def _critic_backward(engine: Any, batch: dict, micro: list[Sample], tokens: int, last: bool, config: SPAConfig,
                     step: int) -> dict[str, float]:
    device = batch["rows"].device
    values = engine(**{key: value for key, value in batch.items() if key != "targets"})
    loss, stats = algos.value_loss(values, flat(micro, "values", device), flat(micro, "returns", device),
                                   torch.ones_like(values), config.ppo.value_clip, normalizer=tokens)
    _check_finite(loss, "value loss", step, config)
    engine.backward(loss, last)
    return {"value_loss": loss.item() * tokens / len(values), "vf_clip_frac": stats["vf_clip_frac"].item()}


def _step(engine: Any, name: str, step: int) -> float:
    norm = engine.step()
    if not math.isfinite(norm):
        raise NonFiniteLoss(f"the {name} gradient norm became {norm} at step {step}; training stopped and the "
                            f"last good checkpoint is kept; lower ppo.actor_lr / ppo.critic_lr")
    return norm


def _check_finite(loss: torch.Tensor, what: str, step: int, config: SPAConfig) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteLoss(f"the {what} became {loss.item()} at step {step}; training stopped, the last good "
                            f"checkpoint in {config.ppo.out} is kept; lower ppo.actor_lr / ppo.critic_lr")


# ---- rollouts and validation ---------------------------------------------------------------------


def train_seeds(config: SPAConfig, seed_counter: int) -> list[int]:
    start = config.rollout.seed + seed_counter
    return list(range(start, start + config.rollout.groups))


def rollout_config(config: SPAConfig, step: int):
    """The rollout settings of ``step``: a sampler seed of its own, so that steps differ and a
    resumed run draws the same samples as an uninterrupted one."""
    return dataclasses.replace(config.rollout, sample_seed=stable_seed(config.rollout.sample_seed, "ppo", step, bits=31))


def _reset_caches(backend: Any) -> None:
    """Start a step's rollouts with no cached KV: caches from before an update are stale, and a
    fresh start makes a step's rollouts the same whether or not the run was resumed before it."""
    if hasattr(backend, "reset"):
        backend.reset()


def validate(config: SPAConfig, backend: Any, models: Models, step: int) -> dict[str, float]:
    """Pass@1 and Pass@k on the fixed eval seeds, as `spa eval` measures them, with the live actor
    (its state perplexity too, when asked for); the report goes to val/step-N.json."""
    from stages.evaluation.runner import evaluate

    out = Path(config.ppo.out) / "val" / f"step-{step}.json"
    val_config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, out=str(out)), quiet=True)
    _reset_caches(backend)
    found = evaluate(val_config, backend, model=models.actor, tokenizer=models.tokenizer)["metrics"]
    k = config.eval.pass_k
    return {"val_pass@1": found["pass@1"], f"val_pass@{k}": found["pass_at_k"].get(str(k)),
            "val_reward": found["mean_reward"]}


def _forget_validations_after(out: Path, step: int) -> None:
    """A resumed run validates the steps after its saved state again; their old reports go."""
    for path in (out / "val").glob("step-*"):
        if int(path.name.split(".")[0].removeprefix("step-")) > step:
            path.unlink()


def rollout_stats(episodes: list[Any], kept: list[Any], samples: list[Sample]) -> dict[str, float]:
    """What the rollouts did, and how far the trainer's log-probs are from the sampler's."""
    n = len(episodes)
    stats = {
        "reward": sum(e.total_reward for e in episodes) / n,
        "success": sum(bool(e.success) for e in episodes) / n,
        "format_penalty": sum(e.format_penalty for e in episodes) / n,
        "turns": sum(len(e.turns) for e in episodes) / n,
        "response_length": sum(sum(e.response_mask) for e in episodes) / n,
        "sequence_length": sum(len(e.token_ids) for e in episodes) / n,
        "kept_episodes": len(kept),
        "kept_reward": sum(e.total_reward for e in kept) / len(kept),
    }
    diffs = [(s.old_logprobs - s.sampler_logprobs)[s.sampled].abs() for s in samples
             if s.sampler_logprobs is not None and s.old_logprobs is not s.sampler_logprobs]  # none: taken from it
    if diffs:
        stats["logp_diff"] = float(torch.cat(diffs).mean())
    if samples[0].values is not None:
        values, returns, mask = padded(samples, "values"), padded(samples, "returns"), step_mask(samples)
        stats["explained_variance"] = algos.explained_variance(values, returns, mask)
        stats["value_mean"] = float(algos.masked_mean(values, mask))
    return stats


# ---- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(run_dir: RunDir, name: str, models: Models, progress: dict[str, Any]) -> None:
    """The actor as a Hugging Face directory ``name`` (step-N/ or final/), then the trainer state."""
    save_hf_checkpoint(models.actor_engine, models.actor, models.tokenizer, run_dir.out / name, models.dist)
    client = {"rng": torch.get_rng_state()}

    def write(tmp: Path) -> None:
        models.actor_engine.save_state(tmp / "actor", client)
        if models.critic_engine is not None:
            models.critic_engine.save_state(tmp / "critic", {})

    run_dir.save_state(models.dist, progress, write)


def load_checkpoint(run_dir: RunDir, models: Models) -> torch.Tensor:
    """Restore the engines from trainer_state/; returns the saved torch RNG state."""
    client = models.actor_engine.load_state(run_dir.state / "actor")
    if models.critic_engine is not None:
        models.critic_engine.load_state(run_dir.state / "critic")
    return client["rng"]


# ---- the loop ----------------------------------------------------------------------------------------


def run(config: SPAConfig) -> dict[str, Any]:
    """Train ``config.model.name`` with PPO on ``config.env.name``; returns a summary of the run."""
    check_config(config)
    ppo, console = config.ppo, Console(config.quiet)
    run_dir = RunDir(ppo.out, "ppo")
    resuming = run_dir.check(settings(config), ppo.resume)
    models = build_models(config)
    saved = run_dir.prepare(models.dist, resuming, to_dict(config), settings(config))
    actor, tokenizer, device, pad_id = models.actor, models.tokenizer, models.dist.device, models.tokenizer.pad_token_id
    step, seed_counter, rng = 0, 0, None
    if saved is not None:
        rng = load_checkpoint(run_dir, models)
        step, seed_counter = saved["step"], saved["seed_counter"]
    _forget_validations_after(run_dir.out, step if saved is not None else -1)
    _announce(config, models, step, saved is not None, console)
    backend = make_backend(config.model, config.rollout, model=actor, tokenizer=tokenizer)
    if saved is not None:
        if config.rollout.backend == "vllm":  # the engine loaded model.name's weights, not the restored ones
            backend.load_weights(actor.named_parameters())
        torch.set_rng_state(rng)  # after the engine, which reseeds the process's generators
    system_length = None
    last: dict[str, Any] = {}

    with artifacts.JsonlAppender(run_dir.metrics) as log, console.progress("ppo", ppo.steps, step) as bar:
        if step == 0 and ppo.val_every:
            with _autocast(models.actor_engine):
                log.append({"step": 0, **validate(config, backend, models, 0)})
        while step < ppo.steps:
            step += 1
            timer = _Timer()
            # 1. rollouts on fresh train seeds, played by the current weights
            actor.eval()
            seeds = train_seeds(config, seed_counter)
            seed_counter += config.rollout.groups
            with timer("rollout"), _autocast(models.actor_engine):
                _reset_caches(backend)
                episodes = play(config.env, rollout_config(config, step), backend, seeds, config.rollout.group_size,
                                model=config.model.name)
            # 2. keep the groups whose rewards differ the most
            scores, groups = [e.total_reward for e in episodes], [e.group for e in episodes]
            kept = [episodes[i] for i in algos.filter_groups(scores, groups, ppo.filter_ratio)]
            if system_length is None:
                system_length = system_prompt_length(tokenizer, episodes[0].token_ids)
            samples = [to_sample(e, ppo.loss_mask, system_length) for e in kept]
            # 3. log-probs and values before the update
            models.actor_engine.module.eval()
            with timer("old_logprobs"):
                if ppo.old_logprobs == "sampler" and all(s.sampler_logprobs is not None for s in samples):
                    for s in samples:
                        s.old_logprobs = s.sampler_logprobs
                else:
                    score(models.actor_engine, samples, "old_logprobs", ppo.micro_batch_tokens, device, pad_id,
                          models.pack)
                if models.reference is not None:
                    with _autocast(models.actor_engine):
                        score(models.reference, samples, "ref_logprobs", ppo.micro_batch_tokens, device, pad_id,
                              models.pack)
            with timer("values"):
                if models.critic_engine is not None:
                    models.critic_engine.module.eval()
                    score(models.critic_engine, samples, "values", ppo.micro_batch_tokens, device, pad_id,
                          models.pack)
            # 4. advantages; 5. update, then hand the new weights to the rollout engine
            compute_advantages(samples, ppo)
            with timer("update"):
                train_stats = update(models, samples, config, step)
                if config.rollout.backend == "vllm":
                    backend.load_weights(actor.named_parameters())

            row = {"step": step, "seed_counter": seed_counter, **rollout_stats(episodes, kept, samples),
                   **train_stats, **timer.seconds}
            update_tokens = sum(len(s.ids) for s in samples) * ppo.ppo_epochs
            row["update_tokens_per_s"] = update_tokens / timer.seconds["seconds_update"]
            if ppo.val_every and (step % ppo.val_every == 0 or step == ppo.steps):
                actor.eval()
                with timer("validation"), _autocast(models.actor_engine):
                    row |= validate(config, backend, models, step)
                row["seconds_validation"] = timer.seconds["seconds_validation"]
            log.append(_finite_or_none(row))
            last = row
            progress = {"step": step, "seed_counter": seed_counter}
            if step == ppo.steps:
                save_checkpoint(run_dir, FINAL_DIR, models, progress)
            elif step % ppo.save_every == 0:
                save_checkpoint(run_dir, f"step-{step}", models, progress)
            bar.update(step, f"reward {row['reward']:.3f} success {row['success']:.2f}")
    console.say(f"ppo: {step} steps done; final checkpoint {run_dir.final}, metrics {run_dir.metrics}")
    return {"out": str(run_dir.out), "steps": step, "final": str(run_dir.final), "last": _finite_or_none(last)}


def _announce(config: SPAConfig, models: Models, step: int, resumed: bool, console: Console) -> None:
    ppo, rollout = config.ppo, config.rollout
    engine = f"ZeRO-{ppo.zero_stage}" if ppo.zero_stage else "plain torch"
    where = f"resuming after step {step}" if resumed else "from the start"
    console.say(f"ppo: {config.model.name} on {config.env.name}, {ppo.steps} steps of {rollout.groups}x"
                f"{rollout.group_size} episodes ({ppo.advantage}, loss mask {ppo.loss_mask}), {rollout.backend} "
                f"rollouts, {engine} on {models.dist.device}; {where}")


def _finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: a figure undefined this step (e.g. the explained variance of constant
    returns) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


class _Timer:
    """Wall-clock seconds per phase: ``with timer("rollout"): ...`` adds to ``seconds_rollout``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"seconds_{phase}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

"""`spa ppo`: multi-turn PPO with a critic, on the same rollout engine as `spa generate`.

One step of the loop (SPA's PPO stage, on RAGEN's trainer; the maths is in `stages.training.ppo_algos`,
the samples in `stages.training.ppo_samples`, the networks in `stages.training.policy`):

1. **Rollout**: ``rollout.groups x rollout.group_size`` episodes on fresh train seeds (the seed
   counter starts at ``rollout.seed`` and advances by ``groups`` every step), played by the live
   actor with the prompt of ``ppo.prompt_mode`` on the states of ``ppo.render_mode`` (the paper's:
   base prompt, coordinates): the hf backend generates with the actor model itself (under ZeRO-3
   with an unsharded copy refreshed after every update); the vllm backend gets the actor's weights
   after every update (and after a resume), and on a GPU sleeps during the update, its memory
   handed to training. An episode's score (the sum of its turn rewards and format penalties, plus
   VAGEN's state rewards with ``ppo.state_reward``) is the reward of its last sampled token.
   Validation plays the ``eval.*`` prompt and render mode.
2. **Filter**: keep the ``ppo.filter_ratio`` of groups with the largest reward std (SPA: 8 of 32);
   with ``ppo.filter_include_zero`` off, never a group whose rewards are all alike (RAGEN's
   ``rollout_filter_include_zero: False``): fewer groups when fewer vary, and when none does the
   step skips 3-5 (its metrics row says ``kept_groups: 0``).
3. **Old log-probs and values**: a no-grad pass of the actor (and of the frozen reference when
   ``ppo.kl_coef > 0``) and of the critic over the kept episodes (one pass for both with a
   shared critic; none for the log-probs with ``ppo.old_logprobs: sampler``). The mean
   |logp_trainer - logp_sampler| over sampled tokens is logged every step (``logp_diff``): it shows
   that the rollouts ran the current weights (it jumps when a weight sync fails). With one PPO epoch
   over one mini-batch (``ppo.score_in_update``, a separate critic or none) there are no such passes:
   the update's first forward of each network is taken before that network's only step, so its
   log-probs and values are the old ones (the ratio is exactly 1), two forward passes saved.
4. **Advantages**: token-level GAE (gamma = lambda = 1 by default, so A_t = R - V_t) whitened over
   the batch; or the bi-level (turn-level) GAE; or GRPO's group-normalised score, without a critic
   (without the group's std with ``ppo.norm_adv_by_std_in_grpo: false``, verl's Dr. GRPO).
5. **Update**: ``ppo.ppo_epochs`` passes over mini-batches of ``ppo.mini_batch`` episodes, in
   order, one optimizer step per mini-batch for actor and critic (`stages.training.trainable`:
   DeepSpeed ZeRO, or plain torch with ``zero_stage: 0``; AdamW, constant lr, gradient clipping):
   the critic's micro-batches and step, then the actor's, so that only one network holds
   gradients at a time (and, when the update scores, the advantages are known before the actor's
   loss). Micro-batches
   hold at most ``ppo.micro_batch_tokens`` padded tokens and accumulate gradients; every loss is
   the ``ppo.loss_agg`` aggregate of the whole mini-batch (`stages.training.loss_agg`: a token
   mean by default), so the micro-batching never changes the objective. The first
   ``ppo.critic_warmup`` steps (verl's ``trainer.critic_warmup``) update the critic alone: no actor
   pass, loss or step.

Token-in/token-out: the sequences trained are the exact token ids the sampler consumed and
produced (`Episode.token_ids`), never re-tokenized text. The loss mask (``ppo.loss_mask``) is the
sampled tokens ("assistant", the paper) or every token after the system prompt ("all", SPA's
released config). Only masked positions are PPO steps, and the actor's and critic's heads run at
those positions only, so prompt and environment tokens cost no vocabulary projection.

**Several processes** (``torchrun --nproc_per_node N -m spa_cli ppo ...``, ``deepspeed --num_gpus N
--no_local_rank --module spa_cli ppo ...``, and their multi-node options) make one data-parallel
run; ``rollout.groups`` and ``ppo.mini_batch`` must split evenly over the N ranks, and a
launcher needs ZeRO (``ppo.zero_stage`` 1-3, or ``auto``: 2). In each step:

* rank r plays its contiguous block of groups (``groups / N``, a group never split) on its own
  rollout engine, on its own GPU; ranks play the same episodes a single process would with vLLM,
  which samples each episode from its own seed, and with the hf backend when
  ``rollout.batch_size`` divides a rank's episodes (``groups / N x group_size``), since its
  sampler is seeded per wave (`stages.agent.proxy`); otherwise the waves, and so the draws, differ;
* every episode's score and group are gathered, so every rank's filter keeps the groups one
  process would keep; the kept episodes are gathered on every rank (a few MB of token ids);
* each mini-batch is split into N equal parts balanced by tokens (`ppo_samples.rank_shares`);
  every rank scores its part (old log-probs, values), the scores are gathered, and every rank
  computes the advantages of the whole batch (the whitening sees every token, as in one process);
* each rank backpropagates its part of every mini-batch, each loss weighted with the normaliser
  of the WHOLE mini-batch (`ppo.loss_agg`: its token count, or its episode count); DeepSpeed sums
  the gradients over ranks (`engine.DeepSpeedEngine.backward` undoes its averaging), so the update
  is the aggregate over all ranks' tokens, not a mean of per-rank aggregates, and equals one
  process's up to float rounding;
* every rank hands the new weights to its own rollout engine (under ZeRO-3 each parameter is
  gathered once and every rank pushes it); rank 0 writes metrics, checkpoints and validation
  reports (validation plays its seeds split over the ranks), and every rank resumes from them.

Outputs in ``ppo.out``, the run directory of `stages.training.checkpoints`: ``metrics.jsonl`` (one
line per step; step 0 holds the validation before training), ``step-N/`` every ``ppo.save_every``
steps and ``final/`` (Hugging Face directories of the actor with its tokenizer),
``val/step-N.json`` (`spa eval` reports with their trajectories, every ``ppo.val_every`` steps
and after the last, before training unless ``ppo.val_before_train`` is off), ``manifest.json``, and
``trainer_state/`` for ``--resume`` (actor and critic engines with their optimizers, the step, the
seed counter and the RNG state), written with each checkpoint; with final/ the engines' only where
``ppo.final_state`` keeps them, for a later ``--resume`` with more ``--steps``.

Simplifications compared with verl/RAGEN (SPA's trainer), nanochat style:

* Rollout and training share each rank's process and device: no Ray, no separate rollout workers,
  no tensor-parallel rollouts (a rank's engine holds the whole model).
* The KL term, when on, is a loss term (``kl_coef`` x the k3 estimator, verl's ``use_kl_loss``),
  not a reward penalty; SPA has it off.
* Dropout is switched off in actor and critic, so old and new log-probs are comparable.
* float16 is refused: loss scaling is not worth it when bf16 exists. ZeRO-3 keeps, on every
  rank, an unsharded copy of the actor for the hf backend (and the state perplexity of the
  validation), since generation cannot run collectively on shards when ranks play different
  episodes. The copy costs the 2 bytes a parameter of the weights that ZeRO-3 would otherwise
  shard, so ZeRO-3 pays off most with vLLM, whose engine holds its own copy anyway.
* Where the engine keeps fp32 weights and computes under bf16 autocast (plain torch, and
  DeepSpeed off CUDA), the hf backend plays on a bf16 copy of the actor, refreshed after every
  update (and validation measures that copy, as `spa eval` measures a bf16 checkpoint): autocast
  would cast every weight again at every decoded token. The sampler's log-probs then come from
  bf16 weights, further from the trainer's than under fp32 (``ppo.old_logprobs: sampler``).
* The critic is the same network (a copy of the same checkpoint) with its LM head replaced by a
  linear value head, zero-initialised so that the first values are 0. Cheaper options:
  ``ppo.critic: shared`` puts that head on the actor's own last hidden state (one network, one
  forward and backward for pg_loss + value_coef x value_loss; the value loss then also moves the
  actor's trunk, as in TRL's original value-head PPO), and ``ppo.lora_rank`` trains LoRA adapters
  of actor and critic on frozen weights (checkpoints and vLLM pushes get them merged).
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

from envs import prompt_modes
from stages.agent.backends import check_backend, make_backend
from stages.agent.env_manager import check_modes
from stages.agent.proxy import RolloutMeter, play
from stages.agent.states import StateReward
from stages.common import distributed, rss, tracking
from stages.common.config import PPOConfig, SPAConfig, to_dict
from stages.common.console import Console
from stages.common.distributed import Dist
from stages.common.errors import UserError
from stages.common.seeds import stable_seed
from stages.evaluation.collapse import collapse_diagnostics
from stages.evaluation.metrics import world_model_metrics
from stages.training import engine as eng
from stages.training import loss_agg, memory, trainable
from stages.training import ppo_algos as algos
from stages.training.checkpoints import FINAL_DIR, RunDir, merged_lora_state_dict, save_hf_checkpoint
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import (
    Sample,
    collate,
    compute_advantages,
    compute_returns,
    fill_scores,
    flat,
    padded,
    rank_micro_batches,
    rank_shares,
    score,
    step_count,
    step_mask,
    system_prompt_length,
    to_sample,
)

#: `stages.training.engine` schedules are cosine; over 2**62 steps the factor is exactly 1.0 (in float64)
#: for any run that will ever happen, which is PPO's constant learning rate.
CONSTANT_LR_STEPS = 2**62
#: AdamW betas of verl's actor and critic (SPA sets none).
ADAM_BETAS = (0.9, 0.999)
#: The metrics of the state reward an episode was paid (a sum over its turns): all, then its two parts.
STATE_REWARD_METRICS = ("state_reward", "state_reward_observation", "state_reward_prediction")
#: The world-model accuracies a step logs, ``wm_<kind>_exact`` (its grid and coordinates apart too) and
#: ``wm_<kind>_turns``, one per kind of `metrics.world_model_metrics`: observations, predictions, and
#: predictions of turns that changed the state.
WORLD_MODEL_KINDS = ("observation", "prediction", "prediction_of_change")
#: What `metrics.world_model_metrics` reads of a turn.
WORLD_MODEL_TURN_KEYS = ("state", "next_state", "observation", "prediction")
#: Settings that may differ between a run and its --resume without changing what is computed.
RESUME_FREE = {"out", "resume", "steps", "val_every", "val_before_train", "save_every", "final_state",
               "micro_batch_tokens", "gradient_checkpointing", "share_prefix", "score_in_update", "deepspeed_config"}


# ---- configuration checks ------------------------------------------------------------------------


def check_config(config: SPAConfig, world: int = 1) -> None:
    """Refuse settings PPO cannot run with, on `world` ranks, each with one line that names the numbers
    (the settings alone: what the machine must have, `run` checks)."""
    ppo, rollout = config.ppo, config.rollout
    env = check_modes(config.env, ppo.prompt_mode, ppo.render_mode, "ppo")  # the game, its options and modes
    if ppo.val_every:
        check_modes(config.env, config.eval.prompt_mode, config.eval.render_mode, "eval")
    if ppo.state_reward != "none" and "world_model" not in prompt_modes(env):
        raise UserError(f"ppo.state_reward={ppo.state_reward} rewards the <observation> and <prediction> of the "
                        f"world-model prompt, and {config.env.name} has none (no states to reward); set "
                        "ppo.state_reward=none")
    if rollout.backend not in ("hf", "vllm"):
        raise UserError(f"ppo needs a model backend: rollout.backend must be hf or vllm, got {rollout.backend!r}")
    if rollout.history_window is not None:
        raise UserError("ppo trains on each episode as one token sequence; set rollout.history_window=null")
    if rollout.temperature <= 0:
        raise UserError(f"ppo samples its rollouts: rollout.temperature must be > 0, got {rollout.temperature}")
    if config.model.dtype == "float16":
        raise UserError("ppo trains in float32 or bfloat16; set model.dtype to auto, float32 or bfloat16")
    if ppo.old_logprobs == "sampler" and (ppo.loss_mask != "assistant" or rollout.top_p < 1
                                          or config.model.dtype not in ("float32", "auto")):
        raise UserError("ppo.old_logprobs=sampler needs ppo.loss_mask=assistant (environment tokens have no "
                        "sampler log-prob), rollout.top_p=1 (the trainer scores the whole vocabulary) and fp32 "
                        "(in bf16 sampler and trainer round differently); or use ppo.old_logprobs=trainer")
    if ppo.critic == "shared" and ppo.advantage == "grpo":
        raise UserError("ppo.critic=shared puts a value head on the actor, and ppo.advantage=grpo uses no critic; "
                        "set ppo.critic=separate, or ppo.advantage=gae / bilevel_gae")
    if ppo.lora_rank and ppo.zero_stage == 3:
        raise UserError("ppo.lora_rank > 0 trains adapters on frozen weights that every rank keeps whole (checkpoints "
                        "and weight pushes merge them); ZeRO-3 would shard them: use ppo.zero_stage 0-2")
    if not ppo.norm_adv_by_std_in_grpo and ppo.advantage != "grpo":
        raise UserError(f"ppo.norm_adv_by_std_in_grpo=false changes GRPO's advantage, and ppo.advantage={ppo.advantage} "
                        "whitens over the batch instead; set ppo.advantage=grpo, or leave it true")
    if ppo.critic_warmup:
        _check_critic_warmup(ppo)
    if ppo.advantage == "grpo" and rollout.group_size < 2:
        raise UserError("ppo.advantage=grpo compares episodes within a group: rollout.group_size must be >= 2")
    kept_groups = algos.groups_to_keep(rollout.groups, ppo.filter_ratio)
    kept = kept_groups * rollout.group_size
    if kept % ppo.mini_batch:
        raise UserError(
            f"ppo.mini_batch={ppo.mini_batch} does not divide the episodes kept per step: "
            f"rollout.groups={rollout.groups} x ppo.filter_ratio={ppo.filter_ratio} -> {kept_groups} groups "
            f"x rollout.group_size={rollout.group_size} = {kept}; pick a mini_batch that divides {kept}")
    if world > 1:
        _check_world(config, world)


def _check_critic_warmup(ppo: PPOConfig) -> None:
    """A critic warm-up needs a critic of its own, and steps left for the actor after it."""
    warmup = f"ppo.critic_warmup={ppo.critic_warmup} trains the critic alone at first"
    if ppo.advantage == "grpo":
        raise UserError(f"{warmup}, and ppo.advantage=grpo has no critic; set ppo.critic_warmup=0, or "
                        "ppo.advantage=gae / bilevel_gae")
    if ppo.critic == "shared":
        raise UserError(f"{warmup}, and ppo.critic=shared trains its value head through the actor's own weights; "
                        "set ppo.critic=separate, or ppo.critic_warmup=0")
    if ppo.critic_warmup >= ppo.steps:
        raise UserError(f"{warmup}, and ppo.steps={ppo.steps} leaves the actor no step; set ppo.critic_warmup "
                        f"below {ppo.steps}")


def _check_world(config: SPAConfig, world: int) -> None:
    """The launcher's world size against the groups (a group is played by one rank) and the
    mini-batch (split evenly for the update)."""
    ppo, rollout = config.ppo, config.rollout
    if ppo.zero_stage == 0:
        raise UserError(f"ppo.zero_stage=0 (plain torch) runs one process, but a launcher started {world}; "
                        "use --set ppo.zero_stage=2 (or 1, 3) under torchrun / deepspeed")
    if rollout.groups % world:
        raise UserError(f"rollout.groups={rollout.groups} does not split over the {world} ranks the launcher "
                        f"started (each rank plays whole groups); use a multiple of {world} groups, or a number "
                        f"of ranks that divides {rollout.groups}")
    if ppo.mini_batch % world:
        raise UserError(f"ppo.mini_batch={ppo.mini_batch} does not split over the {world} ranks the launcher "
                        f"started (each rank trains an equal part); use a multiple of {world}, or a number of "
                        f"ranks that divides {ppo.mini_batch}")


def settings(config: SPAConfig) -> dict[str, Any]:
    """What decides the trained model: model, game, rollouts and PPO settings (but RESUME_FREE)."""
    data = to_dict(config)
    ppo = {k: v for k, v in data["ppo"].items() if k not in RESUME_FREE}
    return {"model": data["model"], "env": data["env"], "rollout": data["rollout"], "ppo": ppo}


# ---- models --------------------------------------------------------------------------------------


@dataclass
class Models:
    # The HF causal LM the actor engine trains (sharded under ZeRO-3); with LoRA its peft wrapper,
    # whose adapters checkpoints and weight pushes merge (`trainable.inner_lm` is what runs).
    actor: nn.Module
    tokenizer: Any
    actor_engine: Any  # trains StepPolicy(actor), with the value head when the critic is shared
    critic_engine: Any | None  # trains ValueModel; None for GRPO and for a shared critic
    shared_critic: bool  # the values come from the actor's own value head (ppo.critic=shared)
    reference: StepPolicy | None  # frozen copy of the initial actor; None without a KL term
    # The unsharded HF model the hf backend generates with (and validation's state perplexity
    # reads): the actor itself, or under ZeRO-3 a copy refreshed after every update (None when
    # nothing needs one: vllm rollouts without state perplexity).
    generator: nn.Module | None
    dist: Dist
    pack: bool  # a micro-batch's samples as one prefix tree (ppo.share_prefix, where the attention allows)


def build_models(config: SPAConfig) -> Models:
    """The checkpoint as actor, critic (a copy with a value head) and optional reference, actor and
    critic in training engines (`stages.training.trainable`)."""
    from stages.common.models import resolve_model

    m, ppo = config.model, config.ppo
    resolve_model(m.name)  # a bad --model fails here, before DeepSpeed starts
    # not the low-memory allocator mode of gradient checkpointing (a mapping of its own for every
    # large tensor): it slows every decoding step of the rollouts; with gradient checkpointing
    # `update` trims the heap after each network's step instead
    dist = trainable.start_processes(m, ppo.zero_stage, config=to_dict(config))
    actor, tokenizer, mixed = trainable.load_trainable(m, dist, zero_stage=ppo.zero_stage, seed=ppo.seed,
                                                       gradient_checkpointing=ppo.gradient_checkpointing,
                                                       lora_rank=ppo.lora_rank, lora_alpha=ppo.lora_alpha,
                                                       without_dropout=True)
    lm = trainable.inner_lm(actor)  # with LoRA: the model with its adapters inside (copies keep them)
    with_critic = ppo.advantage != "grpo"
    shared = with_critic and ppo.critic == "shared"
    critic = ValueModel(copy.deepcopy(lm)) if with_critic and not shared else None
    reference = None
    if ppo.kl_coef > 0:
        reference = StepPolicy(copy.deepcopy(lm).eval().requires_grad_(False), config.rollout.temperature)
    generator = lm
    if ppo.zero_stage == 3:  # the engine will shard the actor: keep a whole copy where one is needed
        needed = config.rollout.backend == "hf" or config.eval.state_ppl
        generator = copy.deepcopy(actor).eval().requires_grad_(False) if needed else None
    compute = eng.autocast_dtype(mixed, ppo.zero_stage, dist.device)
    if compute is not None and generator is not None and config.rollout.backend == "hf" and not ppo.lora_rank:
        # fp32 weights under autocast are cast again at every decoded token: the hf backend plays
        # faster on a copy in the compute precision (bench_generate's engine_bf16 against
        # engine_autocast), which push_weights refreshes
        generator = (copy.deepcopy(lm) if generator is lm else generator).to(compute).eval().requires_grad_(False)

    def engine(module: nn.Module, lr: float):
        optim = eng.OptimSettings(lr, ADAM_BETAS, ppo.weight_decay, ppo.grad_clip, CONSTANT_LR_STEPS, 0.0)
        return trainable.make_engine(module, dist, mixed, ppo.zero_stage, optim, ppo.offload, ppo.deepspeed_config,
                                     out=Path(ppo.out))

    policy = StepPolicy(lm, config.rollout.temperature, value_lr=ppo.critic_lr if shared else None)
    actor_engine = engine(policy, ppo.actor_lr)
    critic_engine = engine(critic, ppo.critic_lr) if critic is not None else None
    # the tree's attention is spa's SDPA (`stages.common.kernels.attention.spa_sdpa`)
    pack = ppo.share_prefix and lm.config._attn_implementation == "sdpa"
    return Models(actor, tokenizer, actor_engine, critic_engine, shared, reference, generator, dist, pack)


def _autocast(engine: Any):
    """The engine's autocast (fp32 weights computing in bf16, see `stages.training.engine`), for
    passes made outside it: the reference's scores and the rollouts, in the actor's precision."""
    return eng.autocast(engine.device, engine.autocast_dtype)


def push_weights(models: Models, backend: Any, config: SPAConfig) -> None:
    """Hand the actor's current weights to this rank's rollout engine (every rank calls this).

    The hf backend generating with the live actor needs only its caches dropped (DeepSpeed writes
    the weights through ``.data``, which its change detection cannot see). Otherwise the weights
    are taken whole (under ZeRO-3 gathered one at a time; with LoRA merged) into the unsharded copy
    and/or vLLM."""
    actor, generator = models.actor, models.generator
    live = trainable.inner_lm(actor)
    if generator is live and config.rollout.backend == "hf":
        _reset_caches(backend)
        return
    if live is not actor:  # LoRA: the base weights plus the adapters' deltas, under the base names
        weights = iter(merged_lora_state_dict(actor).items())
    else:
        weights = models.actor_engine.full_parameters(actor)
    if generator is not None and generator is not live:
        own = dict(generator.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)
        weights = generator.named_parameters()
    if config.rollout.backend == "vllm":
        backend.load_weights(weights)
    else:
        _reset_caches(backend)


# ---- the update ----------------------------------------------------------------------------------


class NonFiniteLoss(UserError):
    """A loss or gradient became NaN or infinite; training stops and keeps the last good checkpoint."""


def update(models: Models, samples: list[Sample], shares: list[list[list[int]]], config: SPAConfig,
           step: int, in_update: bool = False) -> dict[str, float]:
    """``ppo_epochs`` passes of mini-batch updates (``shares``: each mini-batch's part per rank, from
    `rank_shares`), one optimizer step per network and mini-batch, every one against the same old
    log-probs and values (the rollout policy's); returns token-weighted means of the loss terms over
    all ranks, the mean gradient norms and each network's count of optimizer steps. With
    ``in_update`` (`scores_in_update`) the critic's forward passes give the values, then the
    advantages are computed, then the actor's give the old log-probs (unless the sampler's are
    used): the scores a separate pass would give, as neither network has stepped."""
    ppo, dist = config.ppo, models.dist
    pad_id = models.tokenizer.pad_token_id
    # the critic first: with in_update the advantages need its values
    networks = {"critic": models.critic_engine, "actor": models.actor_engine}
    networks = {name: engine for name, engine in networks.items() if engine is not None}
    norms: dict[str, list[float]] = {name: [] for name in networks}  # every network's, those at rest too
    engines = {name: engine for name, engine in networks.items() if name != "actor" or actor_trains(ppo, step)}
    old_in_update = in_update and not _old_from_sampler(samples, ppo)
    for engine in engines.values():
        engine.module.train()
    totals: dict[str, float] = {}
    # the run's last optimizer steps let the moments go unwritten when final/ keeps no optimizer state
    last_update = step == ppo.steps and not ppo.final_state
    for epoch in range(ppo.ppo_epochs):
        for mini_index, mini in enumerate(shares):  # in order: SPA's shuffle=False
            parts = [[samples[i] for i in part] for part in mini]
            tokens = sum(s.steps for part in parts for s in part)  # every loss: an aggregate of the WHOLE mini-batch
            normalizer = loss_agg.batch_normalizer(ppo.loss_agg, tokens, sum(len(part) for part in parts),
                                                   loss_agg.sequence_budget(config, "ppo"))
            micros = rank_micro_batches(parts, ppo.micro_batch_tokens, dist.rank, models.pack)
            batches = [collate(rows, dist.device, pad_id) for rows, _ in micros]
            micro_samples = [[sample for row in rows for sample in row] for rows, _ in micros]  # collate's order
            micro_weights = [loss_agg.token_weights(loss_agg.sequence_index(step_count(rows), dist.device),
                                                    ppo.loss_agg, normalizer) for rows, _ in micros]
            # one network at a time, stepped before the next one's backward: its gradients are freed
            # by then, so the two networks' gradients never exist together (the losses are independent)
            for name, engine in engines.items():
                if name == "actor" and in_update:
                    if models.critic_engine is not None:  # GRPO's advantages need no values
                        _exchange(samples, parts, ["values"], dist)
                    compute_advantages(samples, ppo)
                backward = _actor_backward if name == "actor" else _critic_backward
                scoring = in_update if name == "critic" else old_in_update
                for index, (_, weight) in enumerate(micros):
                    micro = micro_samples[index]
                    terms = backward(models, batches[index], micro, weight, micro_weights[index],
                                     index == len(micros) - 1, config, step, scoring)
                    for key, value in terms.items():  # micro means, weighted by their tokens
                        totals[key] = totals.get(key, 0.0) + value * weight * sum(s.steps for s in micro)
                last_step = last_update and epoch == ppo.ppo_epochs - 1 and mini_index == len(shares) - 1
                norms[name].append(_step(engine, name, step, keep_state=not last_step))
                if dist.device == "cpu" and ppo.gradient_checkpointing:  # the low-memory mode: the pass's
                    rss.return_freed_memory()  # freed activations go, at the cost of faulting them in again
            if old_in_update:  # every rank's, for the logged logp_diff
                _exchange(samples, parts, ["old_logprobs"], dist)
    keys = sorted(totals)
    summed = dict(zip(keys, distributed.all_reduce_sum([totals[k] for k in keys], dist), strict=True))
    seen = ppo.ppo_epochs * sum(s.steps for s in samples)
    stats = {key: value / seen for key, value in summed.items()}
    stats |= {f"{name}_optimizer_steps": len(values) for name, values in norms.items()}
    return stats | {f"{name}_grad_norm": sum(values) / len(values) for name, values in norms.items() if values}


def _actor_backward(models: Models, batch: dict, micro: list[Sample], weight: float, weights: torch.Tensor,
                    last: bool, config: SPAConfig, step: int, scoring: bool) -> dict[str, float]:
    """The policy loss of a micro-batch (+ the value loss with a shared critic), backpropagated;
    ``weights``: each step's weight in the mini-batch's aggregate (`stages.training.loss_agg`);
    ``scoring``: this forward's log-probs are the old ones too."""
    ppo, device = config.ppo, models.dist.device
    logprobs, entropy, values = models.actor_engine(**batch, with_entropy=True, with_values=models.shared_critic)
    if scoring:
        fill_scores([micro], ("old_logprobs",), logprobs)
    pg_loss, stats = algos.policy_loss(logprobs, flat(micro, "old_logprobs", device), flat(micro, "advantages", device),
                                       torch.ones_like(logprobs), ppo.clip_low, ppo.clip_high, ppo.dual_clip,
                                       weights=weights)
    loss = pg_loss - ppo.entropy_coef * (entropy * weights).sum()
    terms = {"entropy": entropy.mean().item(), **{key: value.item() for key, value in stats.items()}}
    if ppo.kl_coef > 0:
        kl = algos.kl_penalty(logprobs, flat(micro, "ref_logprobs", device), "k3")
        loss = loss + ppo.kl_coef * (kl * weights).sum()
        terms["kl_ref"] = kl.mean().item()
    if models.shared_critic:  # one backward through the shared trunk for both losses
        value_loss, value_terms = _value_loss(values, micro, weights, config, device)
        loss = loss + ppo.value_coef * value_loss
        terms |= value_terms
    _check_finite(loss, "policy loss", step, config, models.dist)
    models.actor_engine.backward(loss * weight, last)
    return terms


def _critic_backward(models: Models, batch: dict, micro: list[Sample], weight: float, weights: torch.Tensor,
                     last: bool, config: SPAConfig, step: int, scoring: bool) -> dict[str, float]:
    """The value loss of a micro-batch, backpropagated; ``scoring``: this forward's values are the
    old ones too, and the returns are computed from them."""
    engine = models.critic_engine
    values = engine(**batch)
    if scoring:
        fill_scores([micro], ("values",), values)
        compute_returns(micro, config.ppo)
    loss, terms = _value_loss(values, micro, weights, config, models.dist.device)
    _check_finite(loss, "value loss", step, config, models.dist)
    engine.backward(loss * weight, last)
    return terms


def _value_loss(values: torch.Tensor, micro: list[Sample], weights: torch.Tensor, config: SPAConfig,
                device: Any) -> tuple[torch.Tensor, dict[str, float]]:
    loss, stats = algos.value_loss(values, flat(micro, "values", device), flat(micro, "returns", device),
                                   torch.ones_like(values), config.ppo.value_clip, weights=weights)
    return loss, {key: value.item() for key, value in stats.items()}


def _step(engine: Any, name: str, step: int, keep_state: bool) -> float:
    norm = engine.step(keep_state)  # DeepSpeed's is the norm of the gradient summed over ranks: the same on every rank
    if not math.isfinite(norm):
        raise NonFiniteLoss(f"the {name} gradient norm became {norm} at step {step}; training stopped and the "
                            f"last good checkpoint is kept; lower ppo.actor_lr / ppo.critic_lr")
    return norm


def _check_finite(loss: torch.Tensor, what: str, step: int, config: SPAConfig, dist: Dist) -> None:
    """Stop every rank when any rank's loss is not finite (each decides from the same sum)."""
    here = not torch.isfinite(loss)
    if distributed.all_reduce_sum([float(here)], dist)[0] > 0:
        value = loss.item() if here else "non-finite on another rank"
        raise NonFiniteLoss(f"the {what} became {value} at step {step}; training stopped, the last good "
                            f"checkpoint in {config.ppo.out} is kept; lower ppo.actor_lr / ppo.critic_lr")


# ---- rollouts and validation ---------------------------------------------------------------------


def train_seeds(config: SPAConfig, seed_counter: int) -> list[int]:
    start = config.rollout.seed + seed_counter
    return list(range(start, start + config.rollout.groups))


def state_reward(config: SPAConfig) -> StateReward | None:
    """VAGEN's per-turn state reward, when ``ppo.state_reward`` asks for it."""
    ppo = config.ppo
    if ppo.state_reward == "none":
        return None
    return StateReward(ppo.state_reward, ppo.observation_weight, ppo.prediction_weight)


def rollout_config(config: SPAConfig, step: int):
    """The rollout settings of ``step``: a sampler seed of its own, so that steps differ and a
    resumed run draws the same samples as an uninterrupted one. Runs that differ in ``ppo.seed``
    play the same puzzles with other samples (RL seeds); the default seed adds nothing to the
    sampler's seed, so that default runs draw the samples of docs/experiments.md's."""
    run = () if config.ppo.seed == PPOConfig.seed else (f"seed-{config.ppo.seed}",)
    return dataclasses.replace(config.rollout,
                               sample_seed=stable_seed(config.rollout.sample_seed, "ppo", step, *run, bits=31))


def play_share(config: SPAConfig, backend: Any, step: int, seed_counter: int, dist: Dist,
               meter: RolloutMeter | None = None) -> list[Any]:
    """This rank's episodes of ``step``: its contiguous block of the step's groups, numbered as in
    the whole step (groups ``rank * G/N ..``); `meter` counts them as they are played."""
    seeds = train_seeds(config, seed_counter)
    block = distributed.split_evenly(len(seeds), dist.world, dist.rank)
    return play(config.env, rollout_config(config, step), backend, seeds[block.start:block.stop],
                config.rollout.group_size, prompt_mode=config.ppo.prompt_mode, render_mode=config.ppo.render_mode,
                model=config.model.name, state_reward=state_reward(config), first_group=block.start, meter=meter)


def episode_figures(episode: Any) -> dict[str, Any]:
    """What the filter and the step's metrics need of an episode (all that is gathered of it)."""
    return {"group": episode.group, "score": episode.total_reward, "success": bool(episode.success),
            "format_penalty": episode.format_penalty, "turns": len(episode.turns),
            "response_length": sum(episode.response_mask), "sequence_length": len(episode.token_ids),
            "response_tokens": [t for t, sampled in zip(episode.token_ids, episode.response_mask) if sampled],
            "world_model_turns": [{key: getattr(turn, key) for key in WORLD_MODEL_TURN_KEYS}
                                  for turn in episode.turns],
            **{key: sum(getattr(turn, key) for turn in episode.turns) for key in STATE_REWARD_METRICS}}


def keep_groups(episodes: list[Any], ppo: PPOConfig, dist: Dist) -> tuple[list[dict], list[Any]]:
    """The figures of every rank's episodes, and the episodes (whole) of the groups the filter keeps
    (``ppo.filter_ratio``, ``ppo.filter_include_zero``) on every rank, both in the step's group
    order: every rank sees every score, so every rank keeps the groups one process would keep."""
    figures = [f for part in distributed.all_gather([episode_figures(e) for e in episodes], dist) for f in part]
    kept_index = algos.filter_groups([f["score"] for f in figures], [f["group"] for f in figures], ppo.filter_ratio,
                                     ppo.filter_include_zero)
    kept_groups = {figures[i]["group"] for i in kept_index}
    mine = [e for e in episodes if e.group in kept_groups]
    return figures, [e for part in distributed.all_gather(mine, dist) for e in part]


def actor_trains(ppo: PPOConfig, step: int) -> bool:
    """Whether PPO step `step` (from 1) updates the actor: not in the first ``ppo.critic_warmup`` steps
    (verl's ``trainer.critic_warmup``), which fit the critic to the starting policy's returns first."""
    return step > ppo.critic_warmup


def scores_in_update(models: Models, shares: list[list[list[int]]], ppo: PPOConfig) -> bool:
    """Whether the update's forward passes give the old log-probs and values (``ppo.score_in_update``):
    one epoch over one mini-batch, so each network's first forward is before its only step; not with
    a shared critic, whose one pass gives both but the advantages must precede its loss."""
    return ppo.score_in_update and ppo.ppo_epochs == 1 and len(shares) == 1 and not models.shared_critic


def score_samples(models: Models, samples: list[Sample], shares: list[list[list[int]]], config: SPAConfig,
                  timer: _Timer, in_update: bool = False, with_actor: bool = True) -> None:
    """Old log-probs (and reference log-probs, values) of every sample: each rank scores its parts,
    then every rank gets every score; with ``in_update`` only the reference's (the update gives the rest);
    without ``with_actor`` (a critic warm-up step) only the values, as no policy loss reads the rest."""
    ppo, dist = config.ppo, models.dist
    device, pad_id = dist.device, models.tokenizer.pad_token_id
    parts = [[samples[i] for mini in shares for i in mini[rank]] for rank in range(dist.world)]
    micros = rank_micro_batches(parts, ppo.micro_batch_tokens, dist.rank, models.pack)
    fields = []
    models.actor_engine.module.eval()
    from_sampler = _old_from_sampler(samples, ppo)
    if with_actor:
        with timer("old_logprobs"):
            if from_sampler:
                for sample in samples:  # every rank has every sample's: nothing to exchange
                    sample.old_logprobs = sample.sampler_logprobs
            elif not models.shared_critic and not in_update:  # (a shared critic's pass below gives them)
                fields.append("old_logprobs")
                score(models.actor_engine, micros, ("old_logprobs",), device, pad_id)
            if models.reference is not None:
                fields.append("ref_logprobs")
                with _autocast(models.actor_engine):
                    score(models.reference, micros, ("ref_logprobs",), device, pad_id)
    with timer("values"):
        if models.shared_critic:
            scored = (None if from_sampler else "old_logprobs", None, "values")  # (log-probs, entropies, values)
            fields += [field for field in scored if field]
            score(models.actor_engine, micros, scored, device, pad_id, with_values=True)
        elif models.critic_engine is not None and not in_update:
            fields.append("values")
            models.critic_engine.module.eval()
            score(models.critic_engine, micros, ("values",), device, pad_id)
    if fields:
        with timer("exchange"):
            _exchange(samples, parts, fields, dist)


def _old_from_sampler(samples: list[Sample], ppo: PPOConfig) -> bool:
    return ppo.old_logprobs == "sampler" and all(s.sampler_logprobs is not None for s in samples)


def _exchange(samples: list[Sample], parts: list[list[Sample]], fields: list[str], dist: Dist) -> None:
    """Give every rank the ``fields`` of every sample, each scored by the rank whose part holds it."""
    if dist.world == 1:
        return
    index = {id(sample): i for i, sample in enumerate(samples)}
    mine = {index[id(s)]: [getattr(s, f) for f in fields] for s in parts[dist.rank]}
    for scored in distributed.all_gather(mine, dist):
        for i, values in scored.items():
            for field, value in zip(fields, values, strict=True):
                setattr(samples[i], field, value)


def _reset_caches(backend: Any) -> None:
    """Forget the rollout engine's cached KV (and the hf backend's packed weights). A step's rollouts
    start with none: caches from before an update are stale, and a fresh start makes a step's
    rollouts the same whether or not the run was resumed before it. The update starts with none
    either: they would only sit beside its activations, as would the heap pages the rollouts'
    forwards freed, which go back to the OS too (`rss.return_freed_memory`)."""
    if hasattr(backend, "reset"):
        backend.reset()
    rss.return_freed_memory()


def validate(config: SPAConfig, backend: Any, models: Models, step: int) -> dict[str, float]:
    """Pass@1 and Pass@k on the fixed eval seeds, as `spa eval` measures them, with the live actor
    (its state perplexity too, when asked for), split over the ranks; rank 0 writes the report to
    val/step-N.json."""
    from stages.evaluation.runner import evaluate

    out = Path(config.ppo.out) / "val" / f"step-{step}.json"
    # the report and its episodes name what played: the live actor of this run at this step
    live_actor = dataclasses.replace(config.model, name=f"{config.ppo.out} (step {step})")
    val_config = dataclasses.replace(config, model=live_actor, eval=dataclasses.replace(config.eval, out=str(out)),
                                     quiet=True)
    _reset_caches(backend)
    found = evaluate(val_config, backend, model=models.generator, tokenizer=models.tokenizer,
                     dist=models.dist)["metrics"]
    k = config.eval.pass_k
    return {"val_pass@1": found["pass@1"], f"val_pass@{k}": found["pass_at_k"].get(str(k)),
            "val_reward": found["mean_reward"]}


def _forget_validations_after(out: Path, step: int) -> None:
    """A resumed run validates the steps after its saved state again; their old reports go."""
    for path in (out / "val").glob("step-*"):
        if int(path.name.split(".")[0].removeprefix("step-")) > step:
            path.unlink()


def rollout_stats(figures: list[dict], kept: list[Any], samples: list[Sample],
                  state_reward: bool = False) -> dict[str, float]:
    """What the rollouts did (`figures` of every episode; with `state_reward`, the state reward an
    episode was paid, on average, and its two parts), what the filter saw and kept (``flat_groups``:
    the groups whose rewards did not vary; ``kept_groups``, ``kept_episodes``), whether they are collapsing
    (`stages.evaluation.collapse`), how well they describe the game (`world_model_stats`), and how far
    the trainer's log-probs are from the sampler's."""
    n = len(figures)
    spreads = algos.group_spreads([f["score"] for f in figures], [f["group"] for f in figures])
    stats = {
        "reward": sum(f["score"] for f in figures) / n,
        "success": sum(f["success"] for f in figures) / n,
        "format_penalty": sum(f["format_penalty"] for f in figures) / n,
        "turns": sum(f["turns"] for f in figures) / n,
        "response_length": sum(f["response_length"] for f in figures) / n,
        "sequence_length": sum(f["sequence_length"] for f in figures) / n,
        "flat_groups": sum(algos.is_flat(spread) for spread in spreads.values()),  # no reward spread
        "kept_groups": len({e.group for e in kept}),
        "kept_episodes": len(kept),
        "kept_seeds": sorted({e.seed for e in kept}),  # the puzzles trained on
    }
    if kept:  # none kept: the update was skipped (ppo.filter_include_zero)
        stats["kept_reward"] = sum(e.total_reward for e in kept) / len(kept)
    stats |= collapse_diagnostics([f["response_tokens"] for f in figures], [f["group"] for f in figures])
    stats |= world_model_stats(figures)
    if state_reward:
        stats |= {key: sum(f[key] for f in figures) / n for key in STATE_REWARD_METRICS}
    diffs = [(s.old_logprobs - s.sampler_logprobs)[s.sampled].abs() for s in samples
             if s.sampler_logprobs is not None and s.old_logprobs is not None  # none in a critic warm-up
             and s.old_logprobs is not s.sampler_logprobs]  # none: taken from it
    if diffs:
        stats["logp_diff"] = float(torch.cat(diffs).mean())
    if samples and samples[0].values is not None:
        values, returns, mask = padded(samples, "values"), padded(samples, "returns"), step_mask(samples)
        stats["explained_variance"] = algos.explained_variance(values, returns, mask)
        stats["value_mean"] = float(algos.masked_mean(values, mask))
    return stats


def world_model_stats(figures: list[dict]) -> dict[str, float | int | None]:
    """The world-model accuracy of the step's rollouts, as `spa eval` measures it
    (`metrics.world_model_metrics`, over every episode's turns): for each of `WORLD_MODEL_KINDS`,
    ``wm_<kind>_exact``, the share of the turns that wrote the tag where it equals the true state,
    ``wm_<kind>_grid_exact`` and ``wm_<kind>_coordinates_exact``, the same for each form of the state
    (`states.state_forms`; coordinates over the turns whose true state has them), and
    ``wm_<kind>_turns``, those turns; a share is None when no turn wrote the tag."""
    found = world_model_metrics([{"turns": f["world_model_turns"]} for f in figures])
    return {f"wm_{kind}_{figure}": found[kind][key] for kind in WORLD_MODEL_KINDS
            for figure, key in (("exact", "exact_match"), ("grid_exact", "grid_exact"),
                                ("coordinates_exact", "coordinates_exact"), ("turns", "turns"))}


# ---- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(run_dir: RunDir, name: str, models: Models, progress: dict[str, Any],
                    with_optimizer: bool = True) -> None:
    """The actor as a Hugging Face directory ``name`` (step-N/ or final/), then the trainer state,
    without the engines' unless `with_optimizer` (every rank calls this; rank 0 writes the files,
    each rank its ZeRO shards)."""
    save_hf_checkpoint(models.actor_engine, models.actor, models.tokenizer, run_dir.out / name, models.dist)
    client = {"rng": torch.get_rng_state()}

    def write(tmp: Path) -> None:
        models.actor_engine.save_state(tmp / "actor", client)
        if models.critic_engine is not None:
            models.critic_engine.save_state(tmp / "critic", {})

    run_dir.save_state(models.dist, progress, write if with_optimizer else None)


def check_extendable(run_dir: RunDir, steps: int) -> None:
    """Refuse to extend a finished run that kept no optimizer state (``ppo.final_state: false``)."""
    progress = run_dir.progress()
    if progress is not None and progress["step"] < steps and not (run_dir.state / "actor").is_dir():
        raise UserError(f"{run_dir.out} finished at step {progress['step']} without its optimizer state "
                        f"(ppo.final_state was false), so it cannot go on to step {steps}; train on from "
                        f"{run_dir.final} in a new run")


def load_checkpoint(run_dir: RunDir, models: Models) -> torch.Tensor:
    """Restore the engines from trainer_state/; returns the saved torch RNG state."""
    client = models.actor_engine.load_state(run_dir.state / "actor")
    if models.critic_engine is not None:
        models.critic_engine.load_state(run_dir.state / "critic")
    return client["rng"]


# ---- the loop ----------------------------------------------------------------------------------------


def run(config: SPAConfig) -> dict[str, Any]:
    """Train ``config.model.name`` with PPO on ``config.env.name``; returns a summary of the run."""
    config = trainable.with_engine_stage(config, "ppo")
    world = distributed.launched_world()
    check_config(config, world)
    check_backend(config.model, config.rollout)  # vLLM installed, the model's architecture, the memory
    memory.require_fit(config, "ppo", world)  # on a GPU: trainer, vLLM and activations fit it
    tracking.check(config.tracking)
    ppo = config.ppo
    run_dir = RunDir(ppo.out, "ppo")
    resuming = run_dir.check(settings(config), ppo.resume)  # every rank, before any writes
    if resuming:
        check_extendable(run_dir, ppo.steps)
    models = build_models(config)
    dist, tokenizer = models.dist, models.tokenizer
    console = Console(config.quiet or not dist.main)
    saved = run_dir.prepare(dist, resuming, to_dict(config), settings(config))
    step, seed_counter, rng = 0, 0, None
    if saved is not None:
        step, seed_counter = saved["step"], saved["seed_counter"]
        if step < ppo.steps:  # a finished run has nothing to restore, and may have kept no optimizer
            rng = load_checkpoint(run_dir, models)
    if dist.main:
        _forget_validations_after(run_dir.out, step if saved is not None else -1)
    distributed.barrier(dist)
    _announce(config, models, step, saved is not None, console)
    backend = make_backend(config.model, config.rollout, prompt_mode=ppo.prompt_mode, model=models.generator,
                           tokenizer=tokenizer, colocated=True)
    if rng is not None:
        push_weights(models, backend, config)  # the engine loaded model.name's weights, not the restored ones
        torch.set_rng_state(rng)  # after the engine, which reseeds the process's generators
    system_length = None
    last: dict[str, Any] = {}

    tracker = tracking.start(config, run_dir.out, "ppo", step if saved is not None else None, console,
                             main=dist.main)
    with _closing(models, backend), run_dir.metrics_log(dist) as log, tracker, \
            console.progress("ppo", ppo.steps, step, unit="steps") as bar:
        if step == 0 and ppo.val_every and ppo.val_before_train:
            with _autocast(models.actor_engine):
                row = {"step": 0, **validate(config, backend, models, 0)}
            log.append(row)
            tracker.log(row)
        while step < ppo.steps:
            step += 1
            timer = _Timer()
            # 1. rollouts on fresh train seeds, played by the current weights (this rank's groups)
            models.actor.eval()
            with timer("rollout"), _autocast(models.actor_engine):
                _reset_caches(backend)
                episodes = play_share(config, backend, step, seed_counter, dist, RolloutMeter(bar, f"step {step}"))
                _reset_caches(backend)  # stale once the update starts: the KV and packed weights go before it allocates
            seed_counter += config.rollout.groups
            # 2. keep the groups whose rewards differ the most (every rank sees every score)
            with timer("exchange"):
                figures, kept = keep_groups(episodes, ppo, dist)
            samples: list[Sample] = []
            train_stats: dict[str, float] = {}
            if kept:  # none when ppo.filter_include_zero is off and no group's rewards varied: the update is skipped
                if system_length is None:
                    system_length = system_prompt_length(tokenizer, kept[0].token_ids)
                samples = [to_sample(e, ppo.loss_mask, system_length) for e in kept]
                train_stats = learn(models, backend, samples, config, step, timer, bar)

            row = {"step": step, "seed_counter": seed_counter,
                   **rollout_stats(figures, kept, samples, ppo.state_reward != "none"), **train_stats, **timer.seconds}
            row["peak_rss_gb"] = rss.peak()["peak_rss_gb"]
            last_step = step == ppo.steps
            if ppo.val_every and (last_step or step % ppo.val_every == 0):
                models.actor.eval()
                bar.update(step - 1, f"step {step}: validation")
                with timer("validation"), _autocast(models.actor_engine):
                    row |= validate(config, backend, models, step)
                row["seconds_validation"] = timer.seconds["seconds_validation"]
            log.append(_finite_or_none(row))
            tracker.log(row)
            last = row
            progress = {"step": step, "seed_counter": seed_counter}
            if last_step:
                save_checkpoint(run_dir, FINAL_DIR, models, progress, with_optimizer=ppo.final_state)
            elif step % ppo.save_every == 0:
                save_checkpoint(run_dir, f"step-{step}", models, progress)
            skipped = "" if kept else "; no group's rewards varied, update skipped"
            bar.update(step, f"reward {row['reward']:.3f} success {row['success']:.2f}{skipped}")
    console.say(f"ppo: {step} steps done; final checkpoint {run_dir.final}, metrics {run_dir.metrics}")
    return {"out": str(run_dir.out), "steps": step, "final": str(run_dir.final),
            "last": _finite_or_none(last), **rss.peak()}


def learn(models: Models, backend: Any, samples: list[Sample], config: SPAConfig, step: int, timer: _Timer,
          bar: Any) -> dict[str, float]:
    """Steps 3-5 of a PPO step on the kept episodes' `samples`: their scores, advantages and the
    update, then the new weights handed to the rollout engine; returns the update's figures."""
    ppo, dist = config.ppo, models.dist
    shares = rank_shares(samples, ppo.mini_batch, dist.world)
    trains = actor_trains(ppo, step)
    in_update = trains and scores_in_update(models, shares, ppo)  # a warm-up step's critic scores in its own pass
    # 3. log-probs and values before the update (each rank its part, then all of them), unless
    # the update's own forward passes give them
    bar.update(step - 1, f"step {step}: update on {len(samples)} episodes" + ("" if trains else ", critic alone"))
    score_samples(models, samples, shares, config, timer, in_update, trains)
    # 4. advantages of the whole batch (in the update when it scores); 5. update (a vLLM engine on
    # a GPU sleeps meanwhile, leaving its memory to training), then hand the new weights to the
    # rollout engine, which wakes it
    if not in_update:
        compute_advantages(samples, ppo)
    with timer("update"):
        if config.rollout.backend == "vllm":
            backend.sleep()
        stats = update(models, samples, shares, config, step, in_update=in_update)
        push_weights(models, backend, config)
    update_tokens = sum(len(s.ids) for s in samples) * ppo.ppo_epochs
    return stats | {"update_tokens_per_s": update_tokens / timer.seconds["seconds_update"]}


@contextlib.contextmanager
def _closing(models: Models, backend: Any) -> Iterator[None]:
    """Shut the rollout engine and the training engines down when the run ends, however it ends
    (`spa pipeline` runs the next stage in this process)."""
    try:
        yield
    finally:
        backend.close()
        models.actor_engine.close()
        if models.critic_engine is not None:
            models.critic_engine.close()


def _announce(config: SPAConfig, models: Models, step: int, resumed: bool, console: Console) -> None:
    ppo, rollout, dist = config.ppo, config.rollout, models.dist
    engine = trainable.describe_engine(ppo, dist.device)
    ranks = f" x {dist.world} ranks" if dist.world > 1 else ""
    where = f"resuming after step {step}" if resumed else "from the start"
    precision = trainable.precision_label(config.model, dist.device)
    console.say(f"ppo: {config.model.name} on {config.env.name} ({ppo.prompt_mode} prompt, {ppo.render_mode} "
                f"states), {ppo.steps} steps of {rollout.groups}x{rollout.group_size} episodes ({ppo.advantage}, "
                f"loss mask {ppo.loss_mask}), {rollout.backend} rollouts, {engine} on {dist.device}{ranks} "
                f"({precision}); -> {ppo.out}; {where}")


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

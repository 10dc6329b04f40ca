"""The memory each stage needs on one GPU, planned from the model's shape and the config before
anything loads: what `spa plan` prints, and what `spa sft`, `spa ppo` and `spa pipeline` check on a
GPU before they start (`require_fit`), so that a run that cannot fit is refused in one line, with the
settings that would make it fit, instead of failing hours in.

Model states of a trained model, in bytes per parameter on each GPU, for P parameters on N GPUs in
bf16 with an fp32 master copy and AdamW (the engine's settings, `engine.deepspeed_config`, read in
DeepSpeed's sources; its own `estimate_zero2/3_model_states_mem_needs` count the same, and the tests
compare them):

                         weights            gradients             optimizer   step   CPU (offload)
    plain torch (0)      4                  4                     8           -      -
    ZeRO-1               2                  4, all of them        12/N        -      -
    ZeRO-1 + offload     2                  4, all of them        -           -      16/N
    ZeRO-2               2                  4/N                   12/N        -      -
    ZeRO-2 + offload     2                  4/N                   -           -      16/N
    ZeRO-3               2/N + gathered     4/N, kept             12/N        -      -
    ZeRO-3 + offload     gathered           -                     -           -      18/N

"optimizer" is the fp32 master weights and AdamW's two moments (4 + 8); "step" what exists only at
the optimizer step, when the activations are gone (an fp32 model's ZeRO-2 copy of its gradient
partition, 4/N); "gathered" the modules ZeRO-3 assembles as it goes (DeepSpeed's figure: 4 bytes x
the largest module's parameters); CPU the offloaded master weights, moments and fp32 gradients (and ZeRO-3's weights).
Plain torch trains fp32 weights under bf16 autocast, whose bf16 copies of the weights (2 bytes) live
through the backward. With bf16 weights every stage accumulates gradients in fp32 (the engine's
`grad_accum_dtype`): ZeRO-1 is DeepSpeed's BF16_Optimizer, ZeRO-2 sums into an fp32 partition from
the first micro-batch to the step (DeepSpeed >= 0.19.8), ZeRO-3 is its own optimizer; ZeRO-3
allocates its gradient partition and its buckets once and keeps them, the others exist during the
update only. Offloading the optimizer moves its states, not the gradients' first home: ZeRO-2 still
sums into its fp32 partition on the GPU and copies it to the CPU at the step (DeepSpeed 0.19.8's
`copy_grads_in_partition`), ZeRO-1 keeps every parameter's fp32 `grad_accum` (an fp32 model: its
fp32 gradients, kept on the GPU by neither).
The buckets: the reduce bucket (twice with `overlap_comm`, which the engine turns on with several
GPUs), in fp32 under ZeRO-1, and ZeRO-3's prefetch bucket. An fp32 model has 4-byte weights and
gradients where the table says 2.

Activations are an estimate: the tensors a Llama/Qwen layer keeps for its backward, per token (bf16
inputs of the attention and the MLP and their fp32 norms, queries, keys, values and the attention
output, the MLP's gate, up, activation and product), in every layer, or with gradient checkpointing
each layer's input and one layer recomputed at a time; plus the LM head's vocabulary-wide tensors
at the positions it runs at once: a chunk of `stages.training.policy.head_chunk` positions (or all
of a micro-batch's, when fewer), in fp32: PPO's update holds up to 16 bytes a vocabulary entry in
a checkpointed chunk's backward (the recomputed logits, the log-softmax, the logits' gradient and
a temporary of the entropy's); SFT's step, whose log-probs need no entropy, 8 (the logits and the
log-softmax, whose storage its backward turns into the logits' gradient:
`ppo_algos.logprobs_from_logits`); both with two LM-head-sized weight gradients beside them where
the head trains (a chunk's and its sum with the last; not under LoRA); PPO's scoring pass, no
gradients, 10 (bf16 logits, their fp32 copy and the log-softmax). `tests/test_memory_measured.py`
checks the plain torch plans against the peak a CPU training step really allocates. A micro-batch
holds at most `micro_batch_tokens` tokens and as many positions of the LM head (prefix sharing
computes a shared token once but scores it once per row or episode: both are bounded), or one row or
episode longer than that alone (`micro_batch_size`): SFT's longest row is `sft.max_length` (one row
a micro-batch without packing or sharing), PPO's longest episode is planned from the rollout's
settings (`longest_episode`). Attention is assumed to take memory linear in the tokens (SDPA or
flash-attention, not eager).

Rollouts: vLLM takes `rollout.gpu_memory_utilization` of the GPU, or with `rollout.kv_cache_gb` its
weights and that KV cache (its activations are not counted); either way it starts only where
`gpu_memory_utilization` of the GPU is free (vLLM's `request_memory`). Beside PPO's trainer it sleeps
during the update (weights and KV cache handed back). The hf backend holds the weights (PPO: the
actor itself) and a KV cache of `rollout.batch_size` conversations of `CONVERSATION` tokens.
Every process also holds its CUDA context (`CUDA_CONTEXT`, typical, not counted by torch).

A stage needs the most of its phases: generate and eval, starting and running the rollout engine
(eval's state perplexity adds a bf16 copy of the model beside vLLM); sft, the backward and the
optimizer step; ppo, vLLM's start, the rollout, the scoring pass (old log-probs and values, vLLM
still awake), the backward and the optimizer step. PPO's actor steps before the critic's backward,
so the two networks' gradients are alive together only where they are lasting (ZeRO-3).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.agent.backends.vllm import CONVERSATION
from stages.common.config import SPAConfig, with_overrides
from stages.common.errors import UserError
from stages.training.engine import deepspeed_config

if TYPE_CHECKING:
    from stages.common.models import ModelShape

GiB = 2**30
#: What a process's CUDA context takes on its GPU beside torch's allocations (typical of recent drivers).
CUDA_CONTEXT = GiB // 2
#: The GPU planned for when none is named and none is here: an 80 GB A100 or H100.
DEFAULT_GPU_GIB = 79.2
#: Bytes a vocabulary entry takes at each position the LM head runs at (see the module docstring).
SFT_HEAD_BYTES, UPDATE_HEAD_BYTES, SCORING_HEAD_BYTES = 8, 16, 10
#: The environment's text of the longest episode, in tokens: the system prompt, the instruction and
#: the first state (the shipped games: at most 573, Sokoban's hard room with the world-model prompt),
#: then each later turn's reward, state and format reminder with the chat template's markup (at most
#: 216, FrozenLake 6x6), with SmolLM2's tokenizer: `test_memory_measured` renders every shipped game's.
EPISODE_PROMPT_TOKENS, EPISODE_TURN_TOKENS = 768, 256
#: GPU counts `spa plan` tries when one GPU is too small.
GPU_COUNTS = (2, 4, 8)
STAGE_KINDS = ("generate", "sft", "ppo", "eval")


@dataclass(frozen=True)
class Holding:
    """One trained model's states on one GPU, in bytes (the module docstring's table)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    step: int = 0
    buckets: int = 0
    cpu: int = 0
    #: The gradients and buckets stay allocated between updates (ZeRO-3 allocates them once).
    lasting: bool = False

    def __add__(self, other: Holding) -> Holding:
        sums = [a + b for a, b in zip(dataclasses.astuple(self)[:-1], dataclasses.astuple(other)[:-1])]
        return Holding(*sums, lasting=self.lasting or other.lasting)

    @property
    def resident(self) -> int:
        """What stays on the GPU between updates."""
        return self.weights + self.optimizer + (self.gradients + self.buckets if self.lasting else 0)


def model_states(params: int, gpus: int, zero: dict | None, weight_bytes: int = 2, frozen: int = 0,
                 largest_module: int = 0) -> Holding:
    """The states of a model training `params` parameters (beside `frozen` ones it keeps whole: LoRA's
    base weights) on each of `gpus` GPUs: `zero` is DeepSpeed's "zero_optimization" section, None for
    plain torch; `weight_bytes` 2 for bf16 weights, 4 for fp32."""
    if zero is None:  # fp32 weights, gradients and AdamW moments
        return Holding(weights=4 * (params + frozen), gradients=4 * params, optimizer=8 * params)
    stage, w = zero["stage"], weight_bytes
    offload = zero.get("offload_optimizer", {}).get("device") == "cpu"

    def shard(nbytes: int) -> int:
        return nbytes * params // gpus

    if stage == 3:
        param_offload = zero.get("offload_param", {}).get("device") == "cpu"
        weights = 4 * largest_module + (0 if param_offload else shard(w))
        buckets = w * (int(zero["reduce_bucket_size"]) + int(zero["stage3_prefetch_bucket_size"]))
        if offload:
            return Holding(weights, buckets=buckets, cpu=shard(16) + (shard(w) if param_offload else 0), lasting=True)
        return Holding(weights, shard(4), shard(12), buckets=buckets, lasting=True)  # fp32 gradient partition
    weights = w * (params + frozen)
    if stage == 1 and w == 2 and not offload:  # BF16_Optimizer: fp32 gradients of every parameter, no buckets
        return Holding(weights, 4 * params, shard(12))
    reduced = 4 if stage == 1 else w  # ZeRO-1 reduces in fp32, ZeRO-2 in the weights' precision
    buckets = reduced * int(zero["reduce_bucket_size"]) * (2 if zero.get("overlap_comm") else 1)
    # ZeRO-1: every parameter's fp32 gradient (bf16 weights: the grad_accum it sums in); ZeRO-2: the
    # fp32 partition, which an fp32 model under offload copies to the CPU parameter by parameter
    gradients = 4 * params if stage == 1 else (0 if offload and w == 4 else shard(4))
    if offload:
        return Holding(weights, gradients, buckets=buckets, cpu=shard(16))
    # bf16 weights: the fp32 partition is the step's input; fp32 weights: the step copies it once more
    return Holding(weights, gradients, shard(12), shard(4) if w == 4 else 0, buckets)


def layer_bytes(shape: ModelShape, act_bytes: int = 2) -> int:
    """Bytes one layer keeps per token for its backward (the module docstring's list)."""
    h, attention, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * 4 * h + act_bytes * (2 * h + 2 * attention + 2 * kv + 4 * shape.intermediate)


def longest_episode(config: SPAConfig) -> int:
    """The tokens of the longest episode PPO may train on: every turn's generation limit and the
    environment's text (`EPISODE_PROMPT_TOKENS`, `EPISODE_TURN_TOKENS`)."""
    rollout = config.rollout
    return (EPISODE_PROMPT_TOKENS + (rollout.max_turns - 1) * EPISODE_TURN_TOKENS
            + rollout.max_turns * rollout.max_new_tokens)


def micro_batch_size(kind: str, config: SPAConfig) -> int:
    """The most tokens one forward and backward of stage `kind` ("sft" or "ppo") computes, and the most
    positions its LM head scores: `micro_batch_tokens`, or the longest row or episode, which goes
    alone into a micro-batch of its own (SFT without packing or sharing: one row each)."""
    if kind == "sft":
        s = config.sft
        one_row_each = s.packing is False and not s.share_prefix
        return s.max_length if one_row_each else max(s.max_length, s.micro_batch_tokens)
    return max(config.ppo.micro_batch_tokens, longest_episode(config))


def head_positions(shape: ModelShape, positions: int) -> int:
    """The positions whose vocabulary-wide tensors exist at once: the LM head runs a chunk of them at
    a time (`stages.training.policy.head_logprobs`)."""
    from stages.training.policy import head_chunk

    return min(positions, head_chunk(shape.vocab))


def activations(shape: ModelShape, tokens: int, checkpointing: bool, head_bytes: int, act_bytes: int = 2) -> int:
    """A forward and backward over `tokens` tokens with the LM head at each of them."""
    per_layer = layer_bytes(shape, act_bytes)
    layers = (shape.layers * act_bytes * shape.hidden + per_layer if checkpointing else shape.layers * per_layer)
    return tokens * layers + head_positions(shape, tokens) * head_bytes * shape.vocab


def head_gradients(shape: ModelShape, lora_rank: int, weight_bytes: int) -> int:
    """The LM head's weight gradients that exist at once in the backward of a chunked head
    (`head_positions`) that trains: a chunk's and its sum with the chunks before it (measured by
    `tests/test_memory_measured.py`); none under LoRA, which freezes the head."""
    return 0 if lora_rank else 2 * shape.vocab * shape.hidden * weight_bytes


@dataclass
class StagePlan:
    """One stage's memory on each of `gpus` GPUs of `capacity` bytes: its parts and its phases (each
    phase's total), in bytes; `cpu` is the host memory offloading takes per GPU."""

    name: str
    kind: str
    model: str
    params: int
    gpus: int
    capacity: int
    parts: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    cpu: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def need(self) -> int:
        return max(self.phases.values(), default=0)

    @property
    def peak(self) -> str:
        return max(self.phases, key=self.phases.get) if self.phases else ""

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "model": self.model, "parameters": self.params,
                "gpus": self.gpus, "fits": self.fits, "total_gib": gib(self.need), "peak_phase": self.peak,
                "phases": {k: gib(v) for k, v in self.phases.items()},
                "parts": {k: gib(v) for k, v in self.parts.items()}, "cpu_gib": gib(self.cpu), "notes": self.notes}


def gib(nbytes: int) -> float:
    return round(nbytes / GiB, 2)


def plan_stage(kind: str, config: SPAConfig, shape: ModelShape, gpus: int, capacity: int,
               name: str = "") -> StagePlan:
    """The plan of stage `kind` (generate, sft, ppo, eval) of `config` on `gpus` GPUs of `capacity` bytes."""
    plan = StagePlan(name or kind, kind, shape.name, shape.params, gpus, capacity)
    {"sft": _sft, "ppo": _ppo}.get(kind, _rollout)(plan, config, shape)
    return plan


def _weight_bytes(config: SPAConfig) -> int:
    return 4 if config.model.dtype == "float32" else 2  # "auto" is bf16 on a GPU


def _zero(stage: int, offload: bool, grad_clip: float, path: str, gpus: int, weight_bytes: int) -> dict | None:
    """DeepSpeed's "zero_optimization" section as the engine builds it on CUDA (None: plain torch)."""
    if stage == 0:
        return None
    config = deepspeed_config(stage, offload, grad_clip, "cuda", "bf16" if weight_bytes == 2 else None, path, gpus)
    return config["zero_optimization"]


def _rollout_engine(plan: StagePlan, config: SPAConfig, shape: ModelShape, hf_weights: bool) -> tuple[int, int]:
    """(bytes while it runs, bytes that must be free when it starts) of the rollout engine, recorded
    in `plan.parts`; `hf_weights`: the hf backend loads its own copy of the model."""
    rollout, w = config.rollout, _weight_bytes(config)
    if rollout.backend == "random":
        return 0, 0
    if rollout.backend == "hf":
        weights = w * shape.params if hf_weights else 0
        kv_cache = rollout.batch_size * CONVERSATION * shape.kv_bytes_per_token(w)
        plan.parts |= {"rollout_weights": weights, "kv_cache": kv_cache}
        return weights + kv_cache, weights + kv_cache
    share = int(rollout.gpu_memory_utilization * plan.capacity)
    if rollout.kv_cache_gb is None:
        plan.parts["vllm"] = share
        return share, share
    awake = w * shape.params + int(rollout.kv_cache_gb * GiB)
    plan.parts["vllm"] = awake
    plan.notes.append("vLLM's activations are not counted with rollout.kv_cache_gb set")
    return awake, share


def _rollout(plan: StagePlan, config: SPAConfig, shape: ModelShape) -> None:
    """generate and eval: the rollout engine alone (eval's state perplexity loads a second copy beside vLLM)."""
    if config.rollout.backend == "random":
        plan.notes.append("random actions: nothing on the GPU")
        return
    awake, start = _rollout_engine(plan, config, shape, hf_weights=True)
    plan.parts["context"] = CUDA_CONTEXT
    plan.phases = {"start": start + CUDA_CONTEXT, "rollout": awake + CUDA_CONTEXT}
    if plan.kind == "eval" and config.eval.state_ppl and config.rollout.backend == "vllm":
        plan.parts["perplexity_model"] = _weight_bytes(config) * shape.params
        plan.phases["state perplexity"] = awake + plan.parts["perplexity_model"] + CUDA_CONTEXT


def _record(plan: StagePlan, states: Holding, acts: int) -> None:
    plan.parts |= {"weights": states.weights, "optimizer": states.optimizer, "gradients": states.gradients,
                   "step": states.step, "buckets": states.buckets, "activations": acts, "context": CUDA_CONTEXT}
    plan.cpu = states.cpu


def _update_phases(states: Holding, acts: int, beside: int) -> dict[str, int]:
    """The backward (gradients, buckets and activations alive) and the optimizer step (the activations
    freed, the fp32 step copy made; buckets freed unless kept), `beside` whatever else stays."""
    held = states.weights + states.optimizer + states.gradients + beside
    return {"backward": held + states.buckets + acts,
            "optimizer step": held + states.step + (states.buckets if states.lasting else 0)}


def _sft(plan: StagePlan, config: SPAConfig, shape: ModelShape) -> None:
    s, w = config.sft, _weight_bytes(config)
    zero = _zero(s.engine_stage(on_cuda=True, processes=plan.gpus), s.offload, s.grad_clip, s.deepspeed_config,
                 plan.gpus, w)
    trained, frozen = (s.lora_rank * shape.lora_dims, shape.params) if s.lora_rank else (shape.params, 0)
    states = model_states(trained, plan.gpus, zero, w, frozen, shape.largest_module_params)
    acts = activations(shape, micro_batch_size("sft", config), s.gradient_checkpointing, SFT_HEAD_BYTES, w)
    acts += head_gradients(shape, s.lora_rank, w)
    if zero is None and w == 2:
        acts += 2 * (trained + frozen)  # autocast's bf16 copies of the fp32 weights
    _record(plan, states, acts)
    plan.phases = _update_phases(states, acts, CUDA_CONTEXT)


def _ppo(plan: StagePlan, config: SPAConfig, shape: ModelShape) -> None:
    p, w = config.ppo, _weight_bytes(config)
    stage = p.engine_stage(on_cuda=True, processes=plan.gpus)
    zero = _zero(stage, p.offload, p.grad_clip, p.deepspeed_config, plan.gpus, w)
    with_critic = p.advantage != "grpo"
    shared = with_critic and p.critic == "shared"
    value_head = shape.hidden + 1
    lora = p.lora_rank * shape.lora_dims

    def trained_model(params: int, head: int) -> Holding:
        trained, frozen = (lora + head, params) if p.lora_rank else (params + head, 0)
        return model_states(trained, plan.gpus, zero, w, frozen, shape.largest_module_params)

    states = trained_model(shape.params, value_head if shared else 0)
    models = ["actor"]
    if with_critic and not shared:
        critic = trained_model(shape.params - shape.head_params, value_head)
        # one engine steps at a time: the larger fp32 step copy is the one that counts; and the
        # actor steps (freeing its gradients) before the critic's backward, unless they are lasting
        gradients = states.gradients + critic.gradients if states.lasting else max(states.gradients, critic.gradients)
        states = dataclasses.replace(states + critic, step=max(states.step, critic.step), gradients=gradients)
        models.append("critic")
    master = 4 if zero is None else w
    copies = 0
    if p.kl_coef > 0:
        copies += master * shape.params
        models.append("reference")
    backend = config.rollout.backend
    if (stage == 3 and (backend == "hf" or config.eval.state_ppl)) or \
            (zero is None and w == 2 and backend == "hf" and not p.lora_rank):
        copies += 2 * shape.params  # the unsharded (or bf16) copy the hf backend plays with
        models.append("generator copy")
    plan.notes.append("holds " + ", ".join(models))
    tokens = micro_batch_size("ppo", config)
    acts = activations(shape, tokens, p.gradient_checkpointing, UPDATE_HEAD_BYTES, w)
    acts += head_gradients(shape, p.lora_rank, w)  # the actor's: the critic has no LM head
    if zero is None and w == 2:
        acts += 2 * (shape.params + lora)  # autocast's bf16 copies of the actor's fp32 weights
    _record(plan, states, acts)
    plan.parts["weights"] += copies
    awake, start = _rollout_engine(plan, config, shape, hf_weights=False)
    scores_logits = p.kl_coef > 0 or p.old_logprobs == "trainer"
    scoring = tokens * layer_bytes(shape, w) + (
        head_positions(shape, tokens) * SCORING_HEAD_BYTES * shape.vocab if scores_logits else 0)
    plan.parts["scoring"] = scoring
    resident = states.resident + copies + CUDA_CONTEXT
    plan.phases = {"rollout": resident + awake, "scoring": resident + awake + scoring,
                   **_update_phases(states, acts, copies + CUDA_CONTEXT)}
    if backend == "vllm":
        plan.phases = {"vLLM start": resident + start, **plan.phases}


# ---- when it does not fit ------------------------------------------------------------------------


def _candidates(kind: str, config: SPAConfig, shape: ModelShape, capacity: int) -> list[tuple[str, Any]]:
    """Settings that lower a stage's memory, each (key, value), in the order they are suggested."""
    found: list[tuple[str, Any]] = []
    if kind in ("sft", "ppo"):
        section = getattr(config, kind)
        if not section.offload and section.engine_stage(on_cuda=True, processes=1) > 0:
            found.append((f"{kind}.offload", True))
        if not section.gradient_checkpointing:
            found.append((f"{kind}.gradient_checkpointing", True))
        halved = section.micro_batch_tokens // 2
        if micro_batch_size(kind, with_overrides(config, {f"{kind}.micro_batch_tokens": halved})) < \
                micro_batch_size(kind, config):  # not where the longest row or episode sets the size
            found.append((f"{kind}.micro_batch_tokens", halved))
    if kind != "sft" and config.rollout.backend == "vllm":
        share = _least_share(config, shape, capacity)
        if share < config.rollout.gpu_memory_utilization:
            found.append((SHARE_KEY, share))
    return found


SHARE_KEY = "rollout.gpu_memory_utilization"
SHARE_STEP = 0.05


def _least_share(config: SPAConfig, shape: ModelShape, capacity: int) -> float:
    """The smallest vLLM share, in steps of `SHARE_STEP`, that holds its weights and the KV cache of a
    full batch of conversations (`rollout.batch_size` x `CONVERSATION` tokens)."""
    least = (_weight_bytes(config) * shape.params
             + config.rollout.batch_size * CONVERSATION * shape.kv_bytes_per_token(_weight_bytes(config)))
    return round(math.ceil(least / capacity / SHARE_STEP) * SHARE_STEP, 2)


def fixes(kind: str, config: SPAConfig, shape: ModelShape, gpus: int, capacity: int,
          other_gpus: bool = True) -> str:
    """What would make the stage fit, as the end of one error line: each single setting that does
    (with what it saves; for vLLM's share the largest that fits), else the settings together, in
    order, until they do; and, with `other_gpus`, the fewest GPUs that do."""
    need = plan_stage(kind, config, shape, gpus, capacity).need

    def planned(values: dict[str, Any], count: int = gpus) -> StagePlan:
        return plan_stage(kind, with_overrides(config, values), shape, count, capacity)

    def saving(values: dict[str, Any]) -> str:
        settings = " and ".join(f"{key}={_shown(value)}" for key, value in values.items())
        return f"{settings} (-{(need - planned(values).need) / GiB:.1f} GiB)"

    candidates = _candidates(kind, config, shape, capacity)
    options = []
    for key, value in candidates:
        if planned({key: value}).fits:
            while key == SHARE_KEY and planned({key: round(value + SHARE_STEP, 2)}).fits:
                value = round(value + SHARE_STEP, 2)
            options.append(saving({key: value}))
    together: dict[str, Any] = {}
    for key, value in candidates if not options else []:
        together[key] = value
        if planned(together).fits:
            options.append(saving(together))
            break
    text = "set " + ", or ".join(options) if options else ""
    if other_gpus:
        count = next((n for n in GPU_COUNTS if n > gpus and _splits(kind, config, n) and planned({}, n).fits), None)
        if count is not None:
            text += f"{', or ' if len(options) > 1 else ' or ' if text else ''}run on {count} GPUs"
    return text or "no setting spa plans for makes it fit: use a GPU with more memory, or a smaller model"


def _splits(kind: str, config: SPAConfig, gpus: int) -> bool:
    """Whether the stage can run on `gpus` ranks (PPO splits groups and mini-batches evenly)."""
    if kind != "ppo":
        return True
    return config.rollout.groups % gpus == 0 and config.ppo.mini_batch % gpus == 0


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def verdict(plan: StagePlan) -> str:
    """The stage's need against its GPU: '57.3 GiB per GPU (backward) of 79.2: fits'."""
    word = "fits" if plan.fits else "does not fit"
    return f"{plan.need / GiB:.1f} GiB per GPU ({plan.peak}) of {plan.capacity / GiB:.1f}: {word}"


def too_big(plan: StagePlan, config: SPAConfig, shape: ModelShape, other_gpus: bool = True, who: str = "") -> str:
    """The one-line refusal of a stage that does not fit (`who`, default its name), naming what would
    make it fit."""
    return (f"{who or plan.name} needs {plan.need / GiB:.1f} GiB per GPU of {plan.capacity / GiB:.1f}; "
            f"{fixes(plan.kind, config, shape, plan.gpus, plan.capacity, other_gpus)}")


# ---- the GPU here --------------------------------------------------------------------------------


def gpu_capacity() -> int | None:
    """Total bytes of this process's GPU (LOCAL_RANK's, read without opening a CUDA context on any
    GPU), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_properties(local if local < torch.cuda.device_count() else 0).total_memory


def capacity(gpu_memory_gib: float | None = None) -> int:
    """Bytes of one GPU: `gpu_memory_gib` if given, else this machine's GPU, else `DEFAULT_GPU_GIB`."""
    if gpu_memory_gib:
        return int(gpu_memory_gib * GiB)
    return gpu_capacity() or int(DEFAULT_GPU_GIB * GiB)


def require_fit(config: SPAConfig, kind: str, world: int) -> None:
    """On a CUDA GPU, refuse (one UserError line) stage `kind` of `config` on `world` GPUs when its
    plan exceeds this GPU's memory; nothing on a CPU run. The model's config.json is fetched if
    needed: the run is about to download the model anyway."""
    from stages.common.models import model_shape, pick_device

    if not pick_device(config.model.device).startswith("cuda"):
        return
    shape = model_shape(config.model.name, config.model.trust_remote_code, download=True)
    plan = plan_stage(kind, config, shape, world, gpu_capacity())
    if not plan.fits:
        raise UserError(too_big(plan, config, shape) + f" (spa plan CONFIG --stage {kind} shows every figure)")


def measured_peak_bytes(run, modules) -> int:
    """The most bytes torch's CPU allocator holds while `run()` runs, with `modules`' weights and
    buffers (held before it) counted: every allocation and free under torch's profiler, in order.
    What the plan is checked against (tests/test_memory_measured.py); `bench/profile_sft_step.py
    --allocated` reports it for a step."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for module in modules for t in [*module.parameters(), *module.buffers()]}
    gc.collect()  # garbage of earlier work freed inside the run would count against the step's peak
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    alive = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        alive += nbytes
        peak = max(peak, alive)
    return sum(storages.values()) + peak

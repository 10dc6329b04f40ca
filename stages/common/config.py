"""One typed configuration for every stage, read from YAML and `--set` overrides.

The dataclasses below are the schema, TRL-style: one typed field per setting, its meaning in the
comment above it, its valid range in the field's metadata (`setting(default, ge=..., lt=...)`),
checked whenever a section is built, so a bad number never reaches a stage; NaN and infinity are
refused for every float. Checks that relate settings to each other live in the stage that needs
them (PPO's mini-batch against the episodes it keeps, eval's k against its n). The defaults are
the paper's settings, and `configs/base.yaml` spells every one of them out (a test keeps the two
equal).
A YAML file may start from another with ``inherit: other.yaml`` (a path relative to the file);
mappings merge key by key, everything else replaces. Overrides are ``section.key=value`` with the
value parsed as YAML (``--set rollout.groups=8``, ``--set sft.betas=[0.9,0.95]``).

Unknown keys and wrong types are errors that name the key, the valid choices, and the closest
valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from stages.common.errors import UserError


def _range(ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> dict[str, Any]:
    return {"range": {key: value for key, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt))
                      if value is not None}}


def setting(default: Any, **bounds: float) -> Any:
    """A numeric field with its valid range (`ge`, `gt`, `le`, `lt`), checked by `_Section`."""
    return field(default=default, metadata=_range(**bounds))


_BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_BOUND_OK = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b,
             "lt": lambda v, b: v < b}


class _Section:
    """A config section whose numbers are checked against their fields' ranges when it is built."""

    def __post_init__(self) -> None:
        section = type(self).__name__.removesuffix("Config").lower()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                key = f"{section}.{f.name}" + (f"[{index}]" if isinstance(value, list) else "")
                _check_number(key, item, f.metadata.get("range", {}))


def _check_number(key: str, value: Any, bounds: dict[str, float]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key} must be a finite number, got {value}")
    if not all(_BOUND_OK[name](value, bound) for name, bound in bounds.items()):
        wanted = " and ".join(f"{_BOUND_TEXT[name]} {bound:g}" for name, bound in bounds.items())
        raise UserError(f"{key} must be {wanted}, got {value:g}")


PromptMode = Literal["world_model", "base"]
RenderMode = Literal["coords", "text"]
StateText = Literal["trained", "masked"]


@dataclass
class EnvConfig(_Section):
    """The game. What the agent is shown of it (prompt and render mode) is each stage's own setting:
    `generate.*`, `ppo.*`, `eval.*` (prompt_mode: "world_model" asks for <observation> and
    <prediction> in the think, "base" for think then answer; render_mode: "coords" is the grid plus
    its coordinate line, SPA's text_with_coordinates, "text" the grid alone)."""

    #: A registered game (`spa envs` lists them).
    name: str = "sokoban"
    #: Overrides of the game's own settings, e.g. {num_boxes: 2}, {difficulty: medium}, or for
    #: Sokoban {base_instruction: released} (the base prompt's variant, see envs/sokoban.py).
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig(_Section):
    #: Built-in name (smollm2-135m), a local Hugging Face directory, or a hub id.
    name: str = "smollm2-135m"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    #: Off unless the user asks: a model's own code is not run by default.
    trust_remote_code: bool = False


@dataclass
class RolloutConfig(_Section):
    """The multi-turn agent loop shared by generate, eval and ppo (each stage has its own prompt
    and render mode)."""

    backend: Literal["hf", "vllm", "random"] = "hf"
    #: Puzzles per batch; every episode of a group plays the same seed.
    groups: int = setting(32, ge=1)
    group_size: int = setting(8, ge=1)
    #: First seed (train seeds start at 10000, eval seeds at 123).
    seed: int = setting(10000, ge=0)
    max_turns: int = setting(5, ge=1)
    max_actions_per_turn: int = setting(5, ge=1)
    #: Budget of primitive actions per episode; null takes the game's own (10, 10, 50).
    max_actions_per_traj: int | None = setting(None, ge=1)
    #: Generation limit per turn, in tokens.
    max_new_tokens: int = setting(400, ge=1)
    temperature: float = setting(1.0, ge=0)
    top_p: float = setting(1.0, gt=0, le=1)
    #: Past turns kept in the prompt; null keeps them all.
    history_window: int | None = setting(None, ge=0)
    format_penalty: float = setting(-0.1)
    #: Episodes generated together by the hf backend.
    batch_size: int = setting(64, ge=1)
    #: Seed of the sampler (and of the random backend).
    sample_seed: int = setting(0, ge=0)
    #: The random backend's actions per turn, [min, max] (a uniform count): RandSFT data; SPA's wrapper plays 3.
    random_actions: list[int] = field(default_factory=lambda: [3, 3], metadata=_range(ge=1))
    #: The random backend's reasoning: "fixed", the paper's one sentence; "actions", that sentence
    #: then the actions drawn ("I move Left."), so the prediction follows a stated action.
    random_reasoning: Literal["fixed", "actions"] = "fixed"
    #: The random backend's moves: "any", uniform over the game's actions (the paper's RandSFT);
    #: "effective", uniform over those that change the state (no walking into walls), so that a
    #: prediction is never right by copying the observation.
    random_moves: Literal["any", "effective"] = "any"
    #: vLLM's share of the GPU's memory: weights, activations and KV cache (vllm backend on a GPU).
    gpu_memory_utilization: float = setting(0.6, gt=0, le=1)
    #: GiB of vLLM's KV cache (vllm backend); null: on a GPU what gpu_memory_utilization leaves, on a
    #: CPU what batch_size conversations of 4096 tokens need, at most a quarter of the free memory.
    kv_cache_gb: float | None = setting(None, gt=0)


@dataclass
class GenerateConfig(_Section):
    #: The paper's self-play data: the world-model prompt on coordinate states.
    prompt_mode: PromptMode = "world_model"
    render_mode: RenderMode = "coords"
    out: str = "runs/trajectories.jsonl"
    #: Continue the episodes already in `out` (same settings only); without it an existing file is refused.
    resume: bool = False


@dataclass
class CleanConfig(_Section):
    data: str = "runs/trajectories.jsonl"
    out: str = "runs/sft.jsonl"
    #: "trajectory": one row per episode, every assistant turn trained; "turn": SPA's one row per turn.
    unit: Literal["trajectory", "turn"] = "trajectory"
    #: "ground_truth": SPA; "self_belief": keep the model's own states (the paper's Table 3 ablation).
    states: Literal["ground_truth", "self_belief"] = "ground_truth"
    #: Replace coordinates by random ones in the same format (the paper's Fig. 5 ablation).
    random_coordinates: bool = False
    #: Share of the world-model trajectories whose rows show the base prompt instead (their assistant
    #: turns unchanged, states included): not SPA's (0); lets a small model keep its format under the
    #: base prompt that PPO and the eval arms use.
    base_prompt_fraction: float = setting(0.0, ge=0, le=1)
    filter_format: bool = True
    dedup: bool = True
    success_only: bool = False
    #: Fraction of trajectories held out for validation (split by trajectory).
    val_fraction: float = setting(0.1, ge=0, lt=1)
    seed: int = setting(42, ge=0)
    #: Skip (and count) unreadable input lines instead of stopping.
    skip_bad: bool = False


@dataclass
class SFTConfig(_Section):
    data: str = "runs/sft.jsonl"
    #: Validation rows; empty means the `<data>.val.jsonl` written by `spa clean`, if present.
    val_data: str = ""
    out: str = "runs/sft"
    epochs: int = setting(5, ge=1)
    lr: float = setting(1.0e-4, gt=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata=_range(ge=0, lt=1))
    weight_decay: float = setting(0.01, ge=0)
    warmup_ratio: float = setting(0.1, ge=0, lt=1)
    grad_clip: float = setting(1.0, ge=0)
    #: Rows per optimizer step (summed over GPUs and accumulation).
    global_batch: int = setting(16, ge=1)
    #: Token budget of one micro-batch (rows are packed up to it); bounds memory.
    micro_batch_tokens: int = setting(4096, ge=1)
    max_length: int = setting(2048, ge=2)
    #: The observation and prediction contents of assistant messages: "trained" (the paper's
    #: method, eq. 2); "masked" (the paper's Fig. 4 ablation, what SPA's released trainer does: the
    #: contents become "[MASKED]", in the target and in the history, with no loss on it).
    state_text: StateText = "trained"
    #: Pack several rows into one micro-batch; null: only with flash-attention 2 (see stages/training/sft_data.py).
    packing: bool | None = None
    #: One row per turn (`clean.unit: turn`): keep a trajectory's rows in one optimizer step and compute
    #: them as one sequence, each turn's loss from the longest row (the same loss terms, at the cost of one
    #: row per trajectory). false: the rows are shuffled one by one (SPA's order), each computed alone.
    merge_turn_rows: bool = True
    #: LoRA rank; 0 is a full fine-tune.
    lora_rank: int = setting(0, ge=0)
    lora_alpha: int = setting(64, ge=1)
    #: 0: plain torch, one process, no DeepSpeed; 1-3: DeepSpeed ZeRO stage (CPU or CUDA).
    zero_stage: Literal[0, 1, 2, 3] = 2
    #: Your own DeepSpeed JSON instead of configs/deepspeed/zero{2,3}.json ("auto" values are filled in).
    deepspeed_config: str = ""
    #: CPU optimizer offload (ZeRO-3: parameters too); CUDA only.
    offload: bool = False
    #: Save memory for speed: recompute activations in the backward pass and, on the CPU, hand
    #: freed memory back to the OS at once (the 4 GB SmolLM2 full fine-tune at 2048 tokens).
    gradient_checkpointing: bool = False
    seed: int = setting(1, ge=0)
    #: Also save the resumable state every N optimizer steps (0: at the end of each epoch only).
    save_every_steps: int = setting(0, ge=0)
    #: Stop (resumably) after this many optimizer steps in total; 0 runs every epoch. The schedule
    #: still spans all epochs, so `--resume` later continues the very same run.
    stop_after_steps: int = setting(0, ge=0)
    resume: bool = False


@dataclass
class PPOConfig(_Section):
    #: The paper's RL prompt (State Estimation RL and SPA): the base prompt on coordinate states; a
    #: world-model-trained policy keeps writing its states inside <think>, which the base parser accepts.
    prompt_mode: PromptMode = "base"
    render_mode: RenderMode = "coords"
    #: VAGEN's per-turn reward for correct states (`stages.agent.states`): "none"; "exact" (1 per
    #: state equal to the truth); "cells" (the share of grid cells right). Each turn gains
    #: observation_weight x score(<observation>, shown state) + prediction_weight x
    #: score(<prediction>, state after the turn); a missing tag scores 0. Our weights (VAGEN's
    #: defaults), not the paper's, which are unpublished.
    state_reward: Literal["none", "exact", "cells"] = "none"
    observation_weight: float = setting(0.5, ge=0)
    prediction_weight: float = setting(0.5, ge=0)
    out: str = "runs/ppo"
    steps: int = setting(1000, ge=1)
    #: Constant learning rates (AdamW) of actor and critic.
    actor_lr: float = setting(1.0e-6, gt=0)
    critic_lr: float = setting(1.0e-5, gt=0)
    #: Token-level GAE discount and lambda; 1 and 1 give A_t = R - V_t.
    gamma: float = setting(1.0, ge=0, le=1)
    lam: float = setting(1.0, ge=0, le=1)
    #: "gae": token-level GAE with the critic (SPA); "bilevel_gae": turn-level GAE then token-level
    #: inside each turn; "grpo": group-normalised episode score, no critic.
    advantage: Literal["gae", "bilevel_gae", "grpo"] = "gae"
    #: Discount between turns of the bi-level GAE.
    turn_gamma: float = setting(0.95, ge=0, le=1)
    #: PPO ratio clip: [1 - clip_low, 1 + clip_high]; the dual clip bounds the loss of negative advantages.
    clip_low: float = setting(0.2, gt=0, lt=1)
    clip_high: float = setting(0.28, gt=0)
    dual_clip: float = setting(3.0, gt=1)
    #: The critic may move at most this far from its rollout-time value (clipped value loss).
    value_clip: float = setting(0.5, gt=0)
    entropy_coef: float = setting(0.001, ge=0)
    #: Weight of the k3 KL to a frozen copy of the initial actor (0: no reference model is kept).
    kl_coef: float = setting(0.0, ge=0)
    #: Keep this fraction of groups, those with the largest reward std.
    filter_ratio: float = setting(0.25, gt=0, le=1)
    #: Episodes per optimizer step; must divide the episodes kept per step.
    mini_batch: int = setting(64, ge=1)
    ppo_epochs: int = setting(1, ge=1)
    #: "assistant": the model's own tokens (the paper); "all": every token after the system prompt
    #: (SPA's released config).
    loss_mask: Literal["assistant", "all"] = "assistant"
    #: Padded tokens of one forward/backward (episodes are grouped up to it); bounds memory.
    micro_batch_tokens: int = setting(4096, ge=1)
    #: Compute the first prompt a group's episodes share once per group, in one packed sequence per
    #: group (stages/training/ppo_samples.py); the same losses and gradients. SDPA/eager attention
    #: only: with flash-attention 2 the episodes are passed unpacked.
    pack_groups: bool = True
    #: Where the old log-probs of the ratio come from: "trainer" (a no-grad pass of the actor, and
    #: the logged logp_diff shows sampler and trainer agree) or "sampler" (the rollout's own, which
    #: saves that pass; fp32 only, with top_p 1 and the assistant loss mask, where they agree).
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    #: LoRA adapters of this rank on every linear layer of actor and critic (0: full fine-tuning).
    #: The base weights stay frozen: no weight gradients, no optimizer state for them; the
    #: checkpoints are merged. LoRA usually wants a larger actor_lr than full fine-tuning.
    lora_rank: int = setting(0, ge=0)
    lora_alpha: int = setting(64, ge=1)
    #: "separate": the critic is its own copy of the network with a value head (SPA); "shared": the
    #: value head sits on the actor's last hidden state, and one forward and backward serves both
    #: losses (pg_loss + value_coef x value_loss; the value loss then moves the actor's trunk too,
    #: and the head learns at critic_lr).
    critic: Literal["separate", "shared"] = "separate"
    value_coef: float = setting(0.5, gt=0)
    weight_decay: float = setting(0.01, ge=0)
    grad_clip: float = setting(1.0, ge=0)
    #: 0: plain torch (one process); 1-3: DeepSpeed ZeRO (CPU or CUDA; under ZeRO-3 the hf backend
    #: generates with an unsharded copy of the actor, refreshed after every update).
    zero_stage: Literal[0, 1, 2, 3] = 2
    #: CPU optimizer offload of actor and critic (ZeRO-3: parameters too); CUDA only. What lets a 3B
    #: model's actor and critic fit one 80 GB GPU beside vLLM (`spa plan` shows the figures).
    offload: bool = False
    #: Save memory for speed: recompute activations in the backward pass and, on the CPU, hand
    #: freed memory back to the OS at once (the 4 GB SmolLM2 full fine-tune at 2048 tokens).
    gradient_checkpointing: bool = False
    #: Validate on the eval seeds every N steps, before training and after the last; 0 turns it off.
    val_every: int = setting(10, ge=0)
    #: With val_every, validate the starting model too (step 0; verl's val_before_train). Off where
    #: that model has its own eval already, e.g. the pipeline's SFT arm, to save a full eval.
    val_before_train: bool = True
    #: Write an HF checkpoint step-N/ every N steps (final/ is always written).
    save_every: int = setting(100, ge=1)
    seed: int = setting(1, ge=0)
    resume: bool = False


@dataclass
class EvalConfig(_Section):
    #: As the paper validates its RL runs: the base prompt on coordinate states.
    prompt_mode: PromptMode = "base"
    render_mode: RenderMode = "coords"
    out: str = "runs/report.json"
    #: Number of eval puzzles, seeds first_seed .. first_seed+seeds-1 (disjoint from training).
    seeds: int = setting(128, ge=1)
    first_seed: int = setting(123, ge=0)
    #: Samples per seed; null means pass_k.
    n: int | None = setting(None, ge=1)
    pass_k: int = setting(8, ge=1)
    #: Also measure state perplexity (Table 1 of the paper).
    state_ppl: bool = False
    #: Continue an interrupted eval of the same settings in `out`; without it an existing report is refused.
    resume: bool = False


#: The paper's Table 2 (with Table 7's step-0 rows): what `spa pipeline` runs unless told otherwise.
PAPER_ARMS = ("base", "state_estimation", "vanilla_rl", "state_estimation_rl", "vagen", "spa_sft", "spa")


@dataclass
class PipelineConfig(_Section):
    """`spa pipeline`: arms of the paper's comparison in one run directory (see stages/pipeline.py)."""

    dir: str = "runs/pipeline"
    #: The arms, one row each of table.md, in this order (the first is the reference of the paired
    #: differences): built-in names (stages/pipeline.py lists them) or mappings {name, like, model,
    #: data_env, sft_data, set} that define an arm from a built-in one.
    arms: list[str | dict[str, Any]] = field(default_factory=lambda: list(PAPER_ARMS))
    #: Who plays the self-play data of the SFT arms: "model" (the arm's starting model, as the paper)
    #: or "random" (random actions, the paper's RandSFT; the bootstrap for models too weak to write
    #: the format). The rand_sft arm always plays random actions.
    data_policy: Literal["model", "random"] = "model"
    #: Puzzles of the self-play data, each played `data_group_size` times (SPA: 5 batches of 32
    #: puzzles x 8 = 1280 trajectories); PPO draws its own rollout.groups per step.
    data_groups: int = setting(160, ge=1)
    #: Episodes per puzzle of the self-play data; unset: rollout.group_size, as SPA. 1 plays each
    #: puzzle once: more distinct rooms for the same trajectories.
    data_group_size: int | None = setting(None, ge=1)


@dataclass
class TrackingConfig(_Section):
    """Where `spa sft` and `spa ppo` (and so `spa pipeline`) also send their per-step figures and
    their config; `metrics.jsonl` is always written (see stages/common/tracking.py)."""

    #: TRL's `report_to`: ["none"], or any of "tensorboard" (event files in OUT/tensorboard/) and
    #: "wandb" (a Weights & Biases run in OUT/wandb/). Each is an optional package, imported only
    #: when named here.
    report_to: list[Literal["none", "tensorboard", "wandb"]] = field(default_factory=lambda: ["none"])
    #: "offline": the wandb run is written to disk only (`wandb sync` uploads it later); "online"
    #: uploads as it goes (needs the network and a wandb login).
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_project: str = "spa"


@dataclass
class SPAConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    #: No progress and no status messages (results and errors are still printed).
    quiet: bool = False


# ---- loading -------------------------------------------------------------------------------

INHERIT_KEY = "inherit"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                values: dict[str, Any] | None = None) -> SPAConfig:
    """The default config, updated by a YAML file (with inheritance), then by `key=value` overrides
    (values parsed as YAML), then by already-typed `values` (the CLI's own flags), in that order."""
    raw: dict[str, Any] = _read_yaml_tree(Path(path)) if path else {}
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    for key, value in (values or {}).items():
        _set_dotted(raw, key, value)
    return from_dict(raw)


def with_overrides(config: SPAConfig, values: dict[str, Any]) -> SPAConfig:
    """A copy of `config` with dotted `values` set (``{"sft.epochs": 1}``), checked like a file's."""
    raw = to_dict(config)
    for key, value in values.items():
        _set_dotted(raw, key, value)
    return from_dict(raw)


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise UserError(f"--set expects key.path=value, got {item!r}")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # a plain string such as a path with a colon
    return key.strip(), value


def _read_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path.resolve() in seen:
        raise UserError(f"config {path} inherits from itself")
    data = _read_yaml(path)
    parent = data.pop(INHERIT_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise UserError(f"{path}: '{INHERIT_KEY}' must be a file path")
    return _merge(_read_yaml_tree(path.parent / parent, (*seen, path.resolve())), data)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read config file {path}: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise UserError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(raw: dict[str, Any], cls: type = SPAConfig, prefix: str = "") -> Any:
    """Build the dataclass `cls` from a nested dict, checking every key and type."""
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {_describe(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise UserError(_unknown_key_message(f"{prefix}{key}", str(key), list(fields)))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = from_dict(value, hint, f"{prefix}{key}.")
        else:
            values[key] = _check_type(f"{prefix}{key}", value, hint)
    return cls(**values)


def _unknown_key_message(full_key: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {full_key!r}; valid keys here: {', '.join(valid)}.{hint}"


def _check_type(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(map(str, args))
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            suggestion = f" Did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{key} must be one of {choices}; got {value!r}.{suggestion}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, arg)
            except UserError as err:
                errors.append(str(err))
        raise UserError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, got {_describe(value)}")
        return [_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {_describe(value)}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        return _yaml11_float(key, value)  # PyYAML reads "3e-4" (no dot) as a string
    if hint is bool and not isinstance(value, bool):
        raise UserError(f"{key} must be true or false, got {_describe(value)}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UserError(f"{key} must be an integer, got {_describe(value)}")
    if not isinstance(value, hint):
        raise UserError(f"{key} must be {hint.__name__}, got {_describe(value)}")
    return value


def _yaml11_float(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{key} must be a number, got {text!r} (str)") from None


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def default_of(key: str) -> Any:
    """The built-in default of a dotted config key: ``default_of("rollout.groups") == 32``."""
    node: Any = SPAConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def to_dict(config: SPAConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: SPAConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, allow_unicode=True)

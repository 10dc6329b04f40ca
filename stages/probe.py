"""`spa probe`: score a model's world model directly, one action at a time.

    model + game  ->  probe.json (figures per kind of action), probe.cases.jsonl (one row a case)

Pass@k and the world-model accuracy of `spa eval` measure the states a model writes while it
plays, mixed over whatever actions it chose. A model that copies the board into `<prediction>` is
right whenever its move hit a wall, which uniform random play does about half the time in Sokoban.
This probe asks about every action of held-out states and splits the figures by what the action
does (the game's `action_effect`: Sokoban's move / wall / push / push_blocked, FrozenLake's move /
edge / hole / goal, Sudoku's fill / conflict), so copying shows as exact on "wall" and zero on
"move".

Protocol:

1. States: for each seed of ``first_seed .. first_seed + states - 1`` (`PROBE_FIRST_SEED`, apart
   from the train seeds 10000.. and the eval seeds 123..), the game is reset on the seed and takes
   0 to `MAX_RANDOM_MOVES` random moves (count and moves from a generator seeded by the seed; a
   move that would end the episode is not taken), so the states are not all start positions.
2. Cases: every action of `probe_actions` in that state (Sudoku: every value of every empty cell).
3. Prompt: the chat the agent sees at its first turn with the world-model prompt (`prompts`), in
   the chosen render mode, then the assistant's answer teacher-forced up to the prediction:
   ``<think> <observation>{state}</observation> {reasoning} <prediction>``, with the random
   backend's reasoning sentence naming the action (``rollout.random_reasoning: actions``), which is
   the layout `spa clean` gives RandSFT data, so a model trained on it reads its own format.
4. Prediction: greedy decoding of every case in one batch (the hf backend with temperature 0: the
   prompts' common prefix is prefilled once) up to ``</prediction>``, at most as many tokens as the
   longest true state with its ``</prediction>`` plus `EXTRA_TOKENS`: a longer prediction cannot be
   exact (the margin lets the true text through in another tokenization), and one cut there is
   scored as written up to the cut. Scored against the intended
   next state (FrozenLake: the no-slip outcome) by exact match and cell accuracy
   (`stages.agent.states`), against every possible outcome (``any_outcome``: a slip counts), and
   against the current state (``copies``).
5. Likelihood: where the true next state differs from the current one, the teacher-forced
   log-likelihood of each, followed by ``</prediction>``, in the same context: per-token means
   over the cases (token-weighted) and the share of cases where the true state has the higher
   per-token mean log-likelihood (``true_more_likely``; a sum would favour whichever state
   tokenizes shorter). A copier puts the copy first, however its greedy text reads.
6. Figures: per kind of action (``effects``), over the cases whose action changes the state
   (``changed``: the headline, where copying scores nothing) and over all cases (``all``).

Simplifications: one turn, no history; the actions of one state share its prompt up to the
reasoning sentence, but only the prefix common to every case is computed once (in the decode and
in the likelihood), the rest once per case.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs import TextGameEnv
from stages.agent import prompts
from stages.agent.backends.base import GenerationRequest, SamplingParams
from stages.agent.backends.random import reasoning
from stages.agent.env_manager import check_modes, make_env
from stages.agent.states import cell_accuracy, normalize_state, states_match
from stages.common import artifacts
from stages.common.config import SPAConfig
from stages.common.console import Console, duration
from stages.common.errors import UserError
from stages.common.models import check_model_name, kept_columns
from stages.common.prefix_tree import common_prefix_len
from stages.common.seeds import stable_seed

REPORT_FORMAT = "spa-probe-report"
REPORT_VERSION = 2
#: First probe seed: apart from the eval seeds (123..) and the train seeds (10000..).
PROBE_FIRST_SEED = 1000
DEFAULT_STATES = 32
MAX_RANDOM_MOVES = 3
PREDICTION_END = "</prediction>"
EXTRA_TOKENS = 16

#: [(context, target)] -> per pair, in order: (summed negative log-likelihood of target after
#: context, its tokens).
Likelihood = Callable[[list[tuple[str, str]]], list[tuple[float, int]]]
#: Tokens of one likelihood forward (rows x columns) and logits it keeps (rows x columns x
#: vocabulary): they bound its memory.
FORWARD_TOKENS = 4096
FORWARD_LOGITS = 2 ** 26


@dataclass
class Case:
    """One question: what does `action` do to the state `observation`?"""

    seed: int
    action: str
    effect: str
    observation: str
    outcomes: list[str]  # the intended next state first, then the others the action may lead to
    chat: list[dict[str, str]] = field(repr=False)
    game_name: str = ""

    @property
    def truth(self) -> str:
        return self.outcomes[0]

    @property
    def changes(self) -> bool:
        return normalize_state(self.truth) != normalize_state(self.observation)

    def answer_prefix(self) -> str:
        """The teacher-forced assistant text after the generation prefix, up to the prediction."""
        thought = reasoning(self.game_name, [self.action])
        return f" <observation>{self.observation}</observation> {thought} <prediction>"


def probe_state(config: SPAConfig, render_mode: str, seed: int) -> TextGameEnv:
    """The game at the probe state of `seed` (step 1 of the protocol)."""
    game = make_env(config.env, render_mode)
    game.reset(seed=seed)
    rng = random.Random(stable_seed("probe", seed))
    for _ in range(rng.randint(0, MAX_RANDOM_MOVES)):
        trial = copy.deepcopy(game)
        _, _, terminated, truncated, _ = trial.step(trial.sample_action(rng))
        if terminated or truncated:
            break
        game = trial
    return game


def probe_cases(config: SPAConfig, render_mode: str, seeds: range) -> list[Case]:
    """Every (state, action) case of the probe (steps 1-3 of the protocol)."""
    cases = []
    for seed in seeds:
        game = probe_state(config, render_mode, seed)
        budget = config.rollout.max_actions_per_traj or game.max_actions_per_traj
        state = game.render()
        block = prompts.turn_block(1, state, budget, "world_model", prompts.word_limit(game))
        chat = prompts.build_messages(prompts.instruction_prefix(game, "world_model", budget), [block], [], [])
        for action in game.probe_actions():
            cases.append(Case(seed, action, game.action_effect(action), state, game.next_states(action), chat,
                              game_name=game.name))
    return cases


def run(config: SPAConfig, out: str | Path, states: int = DEFAULT_STATES, first_seed: int = PROBE_FIRST_SEED,
        backend: Any = None, likelihood: Likelihood | None = None) -> dict:
    """Probe the model `config.model` names on `config.env` (render mode `config.eval.render_mode`);
    write the report to `out` and its cases beside it; return the report.

    `backend` (a test's or a notebook's; its `tokenizer` renders the chat) replaces the HF backend
    this would open, and `likelihood` the model's own teacher-forced log-likelihood."""
    render_mode = config.eval.render_mode
    game = check(config, states, first_seed)
    if backend is None:
        check_model_name(config.model.name)  # before the model loads, not after its seconds of work
    out = Path(out)
    artifacts.check_writable(out)
    console = Console(config.quiet)
    started = time.perf_counter()
    opened = backend is None
    if opened:
        backend, likelihood = _open_model(config)
    elif likelihood is None:
        likelihood = model_likelihood(backend.model, backend.tokenizer)
    seeds = range(first_seed, first_seed + states)
    cases = probe_cases(config, render_mode, seeds)
    console.say(f"probe: {config.model.name} on {config.env.name} ({render_mode}), {states} states, "
                f"{len(cases)} cases")
    try:
        contexts = [_render(backend.tokenizer, case) for case in cases]
        predictions = _predict(backend, cases, contexts)
        changing = [(case, context) for case, context in zip(cases, contexts) if case.changes]
        scores = iter(likelihood([(context, text + PREDICTION_END) for case, context in changing
                                  for text in (case.truth, case.observation)]))
        rows = [_score(case, prediction, (next(scores), next(scores)) if case.changes else None)
                for case, prediction in zip(cases, predictions)]
    finally:
        if opened:
            backend.close()
    report = {
        "format": REPORT_FORMAT,
        "format_version": REPORT_VERSION,
        "settings": _settings(config, render_mode, seeds, backend),
        "effects": {effect: summarize([r for r in rows if r["effect"] == effect])
                    for effect in game.action_effects if any(r["effect"] == effect for r in rows)},
        "changed": summarize([r for r in rows if r["changes"]]) if any(r["changes"] for r in rows) else None,
        "all": summarize(rows),
        "cases": str(cases_path(out)),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    artifacts.write_jsonl(cases_path(out), rows)
    artifacts.write_json(out, report)
    console.say(f"probe: wrote {out} in {duration(report['wall_s'])}")
    return report


def check(config: SPAConfig, states: int, first_seed: int = PROBE_FIRST_SEED) -> TextGameEnv:
    """What `run` refuses, refused before any model loads; returns the game."""
    game = check_modes(config.env, "world_model", config.eval.render_mode, "eval")
    if not game.action_effects:
        raise UserError(f"{config.env.name} does not name its actions' effects, so it cannot be probed")
    if states < 1:
        raise UserError(f"the probe needs at least 1 state, got {states}; pass --states 1 or more")
    if first_seed < 0:
        raise UserError(f"the first probe seed must be >= 0, got {first_seed}")
    return game


def cases_path(out: str | Path) -> Path:
    """``probe.json`` -> ``probe.cases.jsonl``."""
    return artifacts.sidecar_path(out, "cases")


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The figures of a set of scored cases (see the module docstring, steps 4 and 5)."""
    n = len(rows)
    figures: dict[str, Any] = {
        "cases": n,
        "exact": sum(r["exact"] for r in rows) / n,
        "cells": sum(r["cells"] for r in rows) / n,
        "any_outcome": sum(r["any_outcome"] for r in rows) / n,
        "copies": sum(r["copies"] for r in rows) / n,
    }
    scored = [r for r in rows if r["likelihood"] is not None]
    if not scored:
        figures["likelihood"] = None
        return figures
    true_nll = sum(r["likelihood"]["true_nll"] for r in scored)
    true_tokens = sum(r["likelihood"]["true_tokens"] for r in scored)
    copy_nll = sum(r["likelihood"]["copy_nll"] for r in scored)
    copy_tokens = sum(r["likelihood"]["copy_tokens"] for r in scored)
    figures["likelihood"] = {
        "cases": len(scored),
        "true_logprob_per_token": -true_nll / true_tokens,
        "copy_logprob_per_token": -copy_nll / copy_tokens,
        "true_more_likely": sum(_true_more_likely(r["likelihood"]) for r in scored) / len(scored),
    }
    return figures


def _true_more_likely(likelihood: dict[str, float]) -> bool:
    """Whether the true state's mean log-likelihood per token beats the copy's: per token, since the
    two texts may tokenize to different lengths and a sum favours the shorter."""
    return likelihood["true_nll"] / likelihood["true_tokens"] < likelihood["copy_nll"] / likelihood["copy_tokens"]


def model_likelihood(model: Any, tokenizer: Any) -> Likelihood:
    """The `Likelihood` of a causal LM, batched.

    Each pair is tokenized whole and split where the context's tokens end (`perplexity`'s
    `split_continuation`). The contexts' longest common token prefix is run once; each pair's
    rest (its own context, then its target) runs from that prefix's keys and values, several pairs
    a forward, right-padded: in a causal model no real token sees the padding after it, so no mask
    is needed and each row's figures equal those of a forward over it alone."""
    import torch

    from stages.evaluation.perplexity import split_continuation

    device = next(model.parameters()).device
    vocabulary = model.get_output_embeddings().weight.shape[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def rows_nll(rows: list[tuple[list[int], list[int]]], prefix: Any) -> list[float]:
        """Summed NLL of each row's target after its context, all after the cached `prefix`."""
        width = max(len(context) + len(target) for context, target in rows)
        first = min(len(context) for context, _ in rows) - 1  # the first column that predicts a target token
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, (context, target) in enumerate(rows):
            ids[i, :len(context) + len(target)] = torch.tensor(context + target)
        cache = None
        if prefix is not None:
            cache = copy.deepcopy(prefix)
            cache.batch_repeat_interleave(len(rows))
        logits = model(input_ids=ids.to(device), past_key_values=cache, use_cache=cache is not None,
                       logits_to_keep=kept_columns(first, width, device)).logits.float()
        sums = []
        for i, (context, target) in enumerate(rows):
            start = len(context) - 1 - first
            logp = torch.log_softmax(logits[i, start:start + len(target)], dim=-1)
            sums.append(float(-logp.gather(1, torch.tensor(target, device=device)[:, None]).sum()))
        return sums

    def nll(pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        if not pairs:
            return []
        split = [split_continuation(tokenizer, context, target) for context, target in pairs]
        if any(not context or not target for context, target in split):
            raise RuntimeError("the probe's likelihood needs a non-empty context and target")
        shared = min(len(context) for context, _ in split) - 1  # every row keeps a token of its context
        for context, _ in split[1:]:
            shared = min(shared, common_prefix_len(split[0][0], context))
        rows = [(context[shared:], target) for context, target in split]
        longest = max(len(context) + len(target) for context, target in rows)
        kept = longest - min(len(context) for context, _ in rows) + 1
        per_forward = max(1, min(FORWARD_TOKENS // longest, FORWARD_LOGITS // (kept * vocabulary)))
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                prefix = None
                if shared:
                    prefix = model(input_ids=torch.tensor([split[0][0][:shared]], device=device), use_cache=True,
                                   logits_to_keep=1).past_key_values
                sums = [value for start in range(0, len(rows), per_forward)
                        for value in rows_nll(rows[start:start + per_forward], prefix)]
        finally:
            model.train(was_training)
        return [(value, len(target)) for value, (_, target) in zip(sums, split)]

    return nll


def _open_model(config: SPAConfig) -> tuple[Any, Likelihood]:
    from stages.agent.backends.hf import HFBackend
    from stages.common.models import load_model

    model, tokenizer = load_model(config.model)
    return HFBackend(model, tokenizer, batch_size=config.rollout.batch_size), model_likelihood(model, tokenizer)


def _render(tokenizer: Any, case: Case) -> str:
    chat = tokenizer.apply_chat_template(case.chat, tokenize=False, add_generation_prompt=True)
    return chat + prompts.GENERATION_PREFIX + case.answer_prefix()


def _predict(backend: Any, cases: list[Case], contexts: list[str]) -> list[str]:
    """Each case's greedy prediction, the text before ``</prediction>`` (step 4)."""
    tokenizer = backend.tokenizer
    longest = max(len(tokenizer.encode(case.truth + PREDICTION_END, add_special_tokens=False)) for case in cases)
    params = SamplingParams(max_new_tokens=longest + EXTRA_TOKENS, temperature=0.0, stop=(PREDICTION_END,))
    requests = [GenerationRequest(f"probe-{case.seed}-{case.action}", tokenizer.encode(context, add_special_tokens=False))
                for case, context in zip(cases, contexts)]
    completions = backend.generate(requests, params)
    backend.release([request.key for request in requests])
    return [completion.text.split(PREDICTION_END)[0] for completion in completions]


def _score(case: Case, prediction: str, likelihoods: tuple[tuple[float, int], tuple[float, int]] | None
           ) -> dict[str, Any]:
    """A case's row: its prediction scored, and (where the action changes the state) the
    likelihoods of the true state and of the copy."""
    row = {
        "seed": case.seed,
        "action": case.action,
        "effect": case.effect,
        "changes": case.changes,
        "observation": case.observation,
        "truth": case.truth,
        "prediction": prediction,
        "exact": states_match(prediction, case.truth),
        "cells": cell_accuracy(prediction, case.truth),
        "any_outcome": any(states_match(prediction, outcome) for outcome in case.outcomes),
        "copies": states_match(prediction, case.observation),
        "likelihood": None,
    }
    if likelihoods is not None:
        (true_nll, true_tokens), (copy_nll, copy_tokens) = likelihoods
        row["likelihood"] = {"true_nll": true_nll, "true_tokens": true_tokens,
                             "copy_nll": copy_nll, "copy_tokens": copy_tokens}
    return row


def _settings(config: SPAConfig, render_mode: str, seeds: range, backend: Any) -> dict[str, Any]:
    model = getattr(backend, "model", None)
    versions = artifacts.package_versions()
    return {
        "model": config.model.name,
        "env": config.env.name,
        "env_options": dict(config.env.options),
        "states": len(seeds),
        "first_seed": seeds.start,
        "max_random_moves": MAX_RANDOM_MOVES,
        "prompt_mode": "world_model",
        "render_mode": render_mode,
        "reasoning": "actions",
        "true_more_likely_by": "mean log-likelihood per token",  # reports that summed differ: not compared
        "dtype": str(getattr(model, "dtype", "")).removeprefix("torch.") or None,
        "spa_version": versions.get("spa"),
        "versions": versions,
    }


# ---- tables --------------------------------------------------------------------------------

HEADINGS = ("effect", "cases", "exact %", "cells %", "any outcome %", "copies %", "LL cases",
            "true logp/tok", "copy logp/tok", "true > copy %")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def table_cells(report: dict) -> list[tuple[str, ...]]:
    """One row per kind of action, then "changed" (when an action changed the state) and "all":
    the figures of `HEADINGS`, as text."""
    def row(name: str, figures: dict) -> tuple[str, ...]:
        ll = figures["likelihood"] or {}
        logp = (f"{ll[key]:.3f}" if ll else "-" for key in ("true_logprob_per_token", "copy_logprob_per_token"))
        return (name, str(figures["cases"]), percent(figures["exact"]), percent(figures["cells"]),
                percent(figures["any_outcome"]), percent(figures["copies"]), str(ll.get("cases", 0)), *logp,
                percent(ll.get("true_more_likely")))

    blocks = [*report["effects"].items(), *([("changed", report["changed"])] if report["changed"] else []),
              ("all", report["all"])]
    return [row(name, figures) for name, figures in blocks]


def headline(report: dict) -> dict[str, float | None]:
    """The figures that tell a world model from a copier: exact and cell accuracy on the cases whose
    action changes the state, and the share of them where the true state is the more likely text."""
    changed = report["changed"] or {}
    return {"changed_exact": changed.get("exact"), "changed_cells": changed.get("cells"),
            "true_more_likely": (changed.get("likelihood") or {}).get("true_more_likely")}


#: Settings that may differ between probe reports put side by side: what was probed, and provenance.
COMPARABLE_DESPITE = ("model", "dtype", "spa_version", "versions")


def compare_rows(paths: Sequence[str | Path], force: bool = False) -> list[dict[str, Any]]:
    """One row per probe report: its model, its `headline`, exact per kind of action and over all
    cases; refused when the reports asked other questions (game, states, prompt), unless `force`."""
    reports = [load_report(path) for path in paths]
    first = reports[0]["settings"]
    for path, report in zip(paths[1:], reports[1:]):
        settings = report["settings"]
        changed = next((key for key in sorted(set(first) | set(settings))
                        if key not in COMPARABLE_DESPITE and first.get(key) != settings.get(key)), None)
        if changed is not None and not force:
            raise UserError(f"{path} was probed with {changed}={settings.get(changed)!r} but {paths[0]} with "
                            f"{changed}={first.get(changed)!r}; compare probes of the same questions, or pass --force")
    return [{"report": str(path), "model": report["settings"]["model"], "env": report["settings"]["env"],
             "cases": report["all"]["cases"], **headline(report),
             "exact": {effect: figures["exact"] for effect, figures in report["effects"].items()} | {
                 "all": report["all"]["exact"]}}
            for path, report in zip(paths, reports)]


def compare_cells(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Headers and cells (percent) of probe reports side by side (`compare_rows`)."""
    effects = list(dict.fromkeys(effect for row in rows for effect in row["exact"]))
    headers = ("report", "model", "cases", "exact, changed %", "cells, changed %", "true > copy %",
               *(f"exact {effect} %" for effect in effects))
    cells = [(row["report"], row["model"], str(row["cases"]), percent(row["changed_exact"]),
              percent(row["changed_cells"]), percent(row["true_more_likely"]),
              *(percent(row["exact"].get(effect)) for effect in effects)) for row in rows]
    return headers, cells


def is_report(path: str | Path) -> bool:
    """Whether the JSON file `path` is a probe report (of any version) rather than, say, an eval
    report; a file that cannot be read as JSON is a UserError."""
    report = artifacts.read_json(path)
    return isinstance(report, dict) and report.get("format") == REPORT_FORMAT


def load_report(path: str | Path) -> dict:
    """A report written by `run`; anything else is a UserError."""
    report = artifacts.read_json(path)
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise UserError(f"{path} is not a spa probe report (no \"format\": \"{REPORT_FORMAT}\")")
    if report.get("format_version") != REPORT_VERSION:
        raise UserError(f"{path} is a probe report of format version {report.get('format_version')}, this spa "
                        f"reads version {REPORT_VERSION}; run spa probe again")
    return report

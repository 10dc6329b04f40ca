"""One eval: play the fixed eval puzzles n times each with a backend, write the report and the
episodes. `spa eval` runs it on a model it loads, `spa ppo` on its live actor (validation).

Protocol (the paper's validation, App. B):

* Puzzles are the seeds ``eval.first_seed .. eval.first_seed + eval.seeds - 1`` (123 onwards by
  default, disjoint from the training seeds that start at 10000); every run of the same settings
  plays the same puzzles.
* The agent is shown the prompt of ``eval.prompt_mode`` on the states of ``eval.render_mode``
  (the paper's validation: the base prompt on coordinates).
* Each puzzle is played ``n`` times (``eval.n``, default ``eval.pass_k``) by sampling at
  ``rollout.temperature`` / ``rollout.top_p`` with ``rollout.max_new_tokens`` tokens a turn (the
  paper: 1.0, 1.0, 400). ``eval.pass_k`` larger than n is refused: Pass@k needs k <= n samples.
* Pass@1 is the mean success over all episodes (sampled, not greedy); Pass@k for every k <= n is
  the unbiased estimator of Chen et al. 2021 averaged over puzzles (`stages.evaluation.metrics`).

Outputs, next to each other: ``eval.out`` (``report.json``, `stages.evaluation.reports`), written
atomically at the end; ``<out stem>.trajectories.jsonl``, every episode appended as it finishes;
and ``report.json.manifest.json``, the settings (`stages.common.runs`: an existing eval continues
with ``eval.resume`` and the same settings, and is refused otherwise).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.agent.env_manager import check_modes
from stages.agent.episode import episode_id
from stages.agent.proxy import RolloutMeter, model_label, play_shared
from stages.common import artifacts, distributed, runs
from stages.common.config import EvalConfig, SPAConfig, to_dict
from stages.common.console import Console
from stages.common.distributed import Dist
from stages.common.errors import UserError
from stages.evaluation import metrics, reports
from stages.evaluation.perplexity import state_perplexity

#: Report settings that may change between an interrupted eval and its resume.
RESUME_FREE = ("versions", "state_ppl")


def sample_plan(config: EvalConfig) -> tuple[int, int]:
    """``(n, k)``: samples per seed and the headline k; k above n is a UserError."""
    n = config.pass_k if config.n is None else config.n
    if config.pass_k > n:
        raise UserError(f"--pass-k {config.pass_k} is larger than --n {n}: Pass@k needs at least k samples "
                        f"per seed; raise --n to {config.pass_k} or lower --pass-k")
    return n, config.pass_k


def check_out(out: str | Path) -> None:
    """Refuse a report path that cannot be written before any episode is played."""
    if Path(out).is_dir():
        raise UserError(f"eval.out ({out}) is a directory; give a .json file path")
    artifacts.check_writable(out)


def eval_seeds(config: EvalConfig) -> list[int]:
    return list(range(config.first_seed, config.first_seed + config.seeds))


def header(config: SPAConfig, resuming: bool, player: str) -> str:
    """The line that says what the eval will do, before a model loads: ``eval: 128 puzzles x 8
    samples = 1024 episodes of up to 5 turns on sokoban (base prompt, coords states); model
    smollm2-135m, hf backend on cpu (float32); -> runs/report.json``."""
    n, _ = sample_plan(config.eval)
    ev = config.eval
    then = ", then the state perplexity" if ev.state_ppl else ""
    return (f"eval: {ev.seeds} puzzles x {n} samples = {ev.seeds * n} episodes of up to {config.rollout.max_turns} "
            f"turns on {config.env.name} ({ev.prompt_mode} prompt, {ev.render_mode} states){then}; {player}; "
            f"-> {ev.out}{runs.RESUMING if resuming else ''}")


def check(config: SPAConfig, backend: str) -> tuple[Any, dict[str, Any], bool]:
    """What can be refused before a model is loaded (`backend` is its kind): the sample plan, the
    output path, the game, and an earlier eval at that path. Returns the game, the report settings
    and whether an interrupted eval of the same settings is continued."""
    n, k = sample_plan(config.eval)
    out = Path(config.eval.out)
    check_out(out)
    env = check_modes(config.env, config.eval.prompt_mode, config.eval.render_mode, "eval")
    settings = reports.report_settings(config, env, n, k, model_label(config.model.name, backend))
    key = {name: value for name, value in settings.items() if name not in RESUME_FREE}
    holds_run = out.exists() or reports.trajectories_path(out).exists()
    return env, settings, runs.start(out, key, config.eval.resume, "eval", holds_run)


def evaluate(config: SPAConfig, backend: Any, *, model: Any = None, tokenizer: Any = None,
             dist: Dist | None = None) -> dict:
    """Run the eval `config` describes with `backend`; write and return the report. `model` and
    `tokenizer` (an HF causal LM and its tokenizer; default: the backend's, else loaded) measure the
    state perplexity when ``eval.state_ppl`` is on.

    Under a launcher (`dist` with several ranks, each with its own backend) the seeds are split
    over the ranks (`stages.agent.proxy.play_shared`); rank 0 writes the one trajectory file and
    the one report (the state perplexity, too), and every rank returns the report."""
    dist = dist or Dist()
    env, settings, resuming = check(config, backend.name)
    n, seeds = settings["n"], eval_seeds(config.eval)
    out, traj_path = Path(config.eval.out), reports.trajectories_path(config.eval.out)
    distributed.barrier(dist)  # every rank has looked at the earlier files before rank 0 changes them
    if dist.main:
        if not resuming:
            traj_path.unlink(missing_ok=True)
        runs.record(out, "eval", to_dict(config), {name: v for name, v in settings.items() if name not in RESUME_FREE})
        artifacts.JsonlAppender(traj_path).close()  # drops a line torn by a kill
    distributed.barrier(dist)

    wanted = {episode_id(config.env.name, seed, sample) for seed in seeds for sample in range(n)}
    played = {row["id"] for row in _rows(traj_path) if row["id"] in wanted}
    appender = artifacts.JsonlAppender(traj_path) if dist.main else contextlib.nullcontext()
    console = Console(config.quiet or not dist.main)
    with appender, console.progress("eval", 0, unit="turns", transient=True) as bar:
        def keep(episode: Any) -> None:
            if dist.main:
                appender.append(episode.to_json())

        play_shared(config.env, config.rollout, backend, seeds, n, dist, prompt_mode=config.eval.prompt_mode,
                    render_mode=config.eval.render_mode, model=config.model.name,
                    skip_ids=frozenset(played), on_episode=keep, meter=RolloutMeter(bar))
    report = _report(config, settings, seeds, env, backend, model, tokenizer, console) if dist.main else None
    return distributed.broadcast(report, dist)


def _report(config: SPAConfig, settings: dict[str, Any], seeds: list[int], env: Any, backend: Any, model: Any,
            tokenizer: Any, console: Console) -> dict:
    """The report of the episodes in the trajectory file, written to ``eval.out``."""
    out, traj_path = Path(config.eval.out), reports.trajectories_path(config.eval.out)
    wanted = {episode_id(config.env.name, seed, sample) for seed in seeds for sample in range(settings["n"])}
    latest = {row["id"]: row for row in _rows(traj_path) if row["id"] in wanted}  # the last copy of an id wins
    trajectories = sorted(latest.values(), key=lambda row: (row["seed"], row["sample"]))

    report_metrics = metrics.summarize(trajectories, lambda action: env.parse_action(action) is not None)
    if config.eval.state_ppl:
        with console.progress("eval state perplexity", len(seeds), unit="states", transient=True) as bar:
            measured = _state_perplexity(config, seeds, backend, model, tokenizer, bar.update)
        report_metrics["state_perplexity"] = {"model": config.model.name, **measured}
    report = {
        "format": reports.REPORT_FORMAT,
        "format_version": reports.REPORT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings,
        "metrics": report_metrics,
        "per_seed": metrics.per_seed_counts(trajectories),
        "trajectories": str(traj_path),
    }
    artifacts.write_json(out, report)
    return report


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return artifacts.read_jsonl(path, skip_bad=True, required=("id", "seed", "sample", "success"))[0]


def _state_perplexity(config: SPAConfig, seeds: list[int], backend: Any, model: Any, tokenizer: Any,
                      progress: Callable[[int], None]) -> dict:
    model = model if model is not None else getattr(backend, "model", None)
    tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
    if model is None:  # the vllm backend holds no HF model in this process
        from stages.common.models import load_model

        model, tokenizer = load_model(config.model)
    return state_perplexity(model, tokenizer, config.env, seeds, prompt_mode=config.eval.prompt_mode,
                            max_actions_per_traj=config.rollout.max_actions_per_traj, progress=progress)

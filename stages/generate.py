"""`spa generate`: self-play rollouts written to trajectories.jsonl (SPA's data generation).

`rollout.groups` puzzles (seeds `rollout.seed`, `rollout.seed + 1`, ...) x `rollout.group_size`
episodes each, played by the policy of `rollout.backend` with the prompt of `generate.prompt_mode`
on the states of `generate.render_mode` (the paper's: the world-model prompt on coordinates).
Each finished episode is appended to `generate.out` and flushed, so a killed run keeps what it
finished: the same command with `--resume` skips the episodes already in the file. The manifest
beside the file (`<out>.manifest.json`) records the settings (`stages.common.runs`); resuming
into a file made with other settings is refused rather than mixing two datasets (only `groups`,
`group_size`, `seed` and throughput settings may change, which add episodes without changing how
they are made).

Under a launcher (`torchrun --nproc_per_node N -m spa_cli generate ...`) each rank opens its own
backend and plays its share of the groups (`stages.agent.proxy.play_shared`); rank 0 writes the
one file, holding the episodes a one-process run with the same seeds writes.

SPA generates 5 batches x 32 groups x 8 samples = 1280 trajectories from seeds 10000-10159; here
that is one command with `--groups 160`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from stages.agent.backends import backend_device, describe_player, make_backend
from stages.agent.env_manager import check_modes
from stages.agent.episode import Episode, episode_id
from stages.agent.proxy import RolloutMeter, model_label, play_shared
from stages.common import artifacts, distributed, runs
from stages.common.config import SPAConfig, to_dict
from stages.common.console import Console
from stages.common.errors import UserError

#: Settings that may change between a run and its resume: they add episodes or change speed only.
RESUMABLE = ("groups", "group_size", "seed", "batch_size", "gpu_memory_utilization", "kv_cache_gb")


def run(config: SPAConfig, backend: Any = None) -> dict[str, Any]:
    """Play the episodes the config asks for that `generate.out` lacks; return and print a summary.
    `backend` (a notebook's or a test's) replaces the one `rollout.backend` would open."""
    out = Path(config.generate.out)
    modes = {"prompt_mode": config.generate.prompt_mode, "render_mode": config.generate.render_mode}
    check_modes(config.env, **modes, section="generate")  # the game, its options and modes
    if out.is_dir():
        raise UserError(f"generate.out ({out}) is a directory; give a .jsonl file path")
    artifacts.check_writable(out)
    resuming = runs.start(out, settings(config), config.generate.resume, "generate",
                          holds_run=out.is_file() and out.stat().st_size > 0)
    dist = distributed.start(backend_device(config.model, config.rollout) if backend is None else "cpu",
                             to_dict(config))
    console = Console(config.quiet or not dist.main)
    opened = backend is None
    console.say(header(config, resuming, describe_player(config.model, config.rollout, dist.world, backend)))
    if opened:
        backend = make_backend(config.model, config.rollout, prompt_mode=config.generate.prompt_mode)
    if dist.main:
        runs.record(out, "generate", to_dict(config), settings(config), summary=None)  # before any episode
        if resuming:
            artifacts.JsonlAppender(out).close()  # drop a line torn by a kill before reading
        else:
            out.unlink(missing_ok=True)
    distributed.barrier(dist)
    done_ids = _episodes_in(out) if resuming else set()

    rollout = config.rollout
    seeds = list(range(rollout.seed, rollout.seed + rollout.groups))
    wanted = [episode_id(config.env.name, seed, sample) for seed in seeds for sample in range(rollout.group_size)]
    todo = [key for key in wanted if key not in done_ids]
    appender = artifacts.JsonlAppender(out) if dist.main else contextlib.nullcontext()
    with appender, console.progress("generate", 0, unit="turns", transient=True) as bar:
        def keep(episode: Episode) -> None:
            if dist.main:
                appender.append(episode.to_json())

        meter = RolloutMeter(bar)
        play_shared(config.env, rollout, backend, seeds, rollout.group_size, dist, **modes, model=config.model.name,
                    skip_ids=frozenset(done_ids), on_episode=keep, meter=meter)
    if opened:
        backend.close()  # a vLLM engine's memory goes back before the next pipeline stage
    (generated,) = distributed.all_reduce_sum([meter.tokens], dist)
    summary = None
    if dist.main:
        summary = summarize(out, set(wanted), new=len(todo), seconds=meter.seconds(), tokens=int(generated))
        runs.record(out, "generate", to_dict(config), settings(config), summary=summary)
        print_summary(summary, console)
    return distributed.broadcast(summary, dist)


def header(config: SPAConfig, resuming: bool, player: str) -> str:
    """The line that says what the run will do, before a model loads: ``generate: 256 episodes (32
    groups x 8) of up to 5 turns on sokoban; model smollm2-135m, hf backend on cpu (float32);
    -> runs/trajectories.jsonl``."""
    rollout = config.rollout
    episodes = rollout.groups * rollout.group_size
    groups = f"{rollout.groups} group{'s' if rollout.groups > 1 else ''}"
    return (f"generate: {episodes} episodes ({groups} x {rollout.group_size}) of up to "
            f"{rollout.max_turns} turns on {config.env.name}; {player}; -> {config.generate.out}"
            f"{runs.RESUMING if resuming else ''}")


def settings(config: SPAConfig) -> dict[str, Any]:
    """What decides how an episode is made; two runs with equal settings may share one file."""
    data = to_dict(config)
    rollout = {k: v for k, v in data["rollout"].items() if k not in RESUMABLE}
    return {"env": data["env"], "model": model_label(config.model.name, config.rollout.backend), "rollout": rollout,
            "prompt_mode": config.generate.prompt_mode, "render_mode": config.generate.render_mode}


def _episodes_in(out: Path) -> set[str]:
    rows, _ = artifacts.read_jsonl(out, skip_bad=True, required=("id",))
    return {row["id"] for row in rows}


# ---- summary ---------------------------------------------------------------------------------------


def summarize(out: Path, wanted: set[str], new: int, seconds: float, tokens: int) -> dict[str, Any]:
    """Figures over the episodes of this config in `out` (resumed ones included)."""
    rows, bad = artifacts.read_jsonl(out, skip_bad=True, required=("id", "turns", "success"))
    latest = {row["id"]: row for row in rows if row["id"] in wanted}
    episodes = list(latest.values())
    turns = [turn for row in episodes for turn in row["turns"]]
    return {
        "out": str(out),
        "episodes": len(episodes),
        "new_episodes": new,
        "success_rate": _ratio(sum(bool(row["success"]) for row in episodes), len(episodes)),
        "format_ok_rate": _ratio(sum(bool(turn.get("format_ok")) for turn in turns), len(turns)),
        "mean_turns": _ratio(len(turns), len(episodes)),
        "mean_reward": _ratio(sum(row.get("total_reward", 0.0) for row in episodes), len(episodes)),
        "bad_lines": bad,
        "tokens": tokens,
        "seconds": round(seconds, 2),
    }


def _ratio(part: float, whole: int) -> float | None:
    return part / whole if whole else None


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def print_summary(summary: dict[str, Any], console: Console) -> None:
    turns = "n/a" if summary["mean_turns"] is None else f"{summary['mean_turns']:.2f}"
    console.result(f"generate: {summary['episodes']} episodes ({summary['new_episodes']} new) in {summary['out']}; "
                f"success {_percent(summary['success_rate'])}, "
                f"format-valid turns {_percent(summary['format_ok_rate'])}, mean turns {turns}")

"""How good a world model does RandSFT make on a CPU, for its cost? One point of the curve a run.

A point is: `--games` RandSFT games (random actions, `--actions MIN MAX` a turn, up to `--turns`
turns, `--reasoning` fixed or naming the actions, `--moves` any or only those that change the
state, the true states filled in by `spa clean`, one
row per `--unit`, `--base-prompt-fraction` of them shown with the base prompt), world-model SFT of the
bundled model for `--epochs` epochs, then the world-model accuracy of each epoch's checkpoint on
unseen rooms (one sample each, the world-model prompt): well-formed turns,
exact observations, exact predictions (all, and of the turns whose actions changed the state: a
copied observation is exact whenever they changed nothing) and prediction cells, with the SFT's
wall time and tokens;
and, on the same rooms, its well-formed turns and successes with the base prompt (the prompt PPO
and the eval arms use: the format learnt on one prompt need not carry over to the other).
The rooms measured are tuning rooms (seeds 20000.. by default): unseen in training, and not the
eval seeds 123.. that the reported results use, so that choosing configs from this curve tunes
nothing on the eval set.
`--from-model` starts the SFT from another checkpoint and `--self-play` makes the data by letting
that model play (the paper's data source, once the model writes the format) instead of random
actions.

Each run appends one JSON line per evaluated epoch to `--results` (default
experiments/wm_curve/wm_curve.jsonl) and prints it; `--plot` draws every line of that file as
accuracy against the SFT's computed tokens, an earlier round's included: a cost that compares across
machines and runs, where minutes do not. One point takes from minutes to hours on two cores; the
findings are in docs/experiments.md:

    python experiments/wm_curve/wm_curve.py --env sokoban --games 64 --epochs 3 --actions 1 1
    python experiments/wm_curve/wm_curve.py --plot experiments/wm_curve/wm_curve.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_RESULTS = HERE / "wm_curve.jsonl"


def run_point(args: argparse.Namespace) -> list[dict]:
    from stages import clean, generate, sft
    from stages.common.config import load_config

    name = args.name or (f"{args.env}-g{args.games}-a{args.actions[0]}-{args.actions[1]}-t{args.turns}-{args.unit}"
                         f"-e{args.epochs}" + ("-selfplay" if args.self_play else "")
                         + ("-named" if args.reasoning == "actions" else "")
                         + ("-effective" if args.moves == "effective" else "")
                         + (f"-bp{round(100 * args.base_prompt_fraction)}" if args.base_prompt_fraction else ""))
    work = Path(args.work) / name
    common = [f"env.name={args.env}", f"model.dtype={args.dtype}", "quiet=true",
              f"rollout.max_turns={args.turns}", f"rollout.max_new_tokens={args.max_new_tokens}"]
    data = load_config(None, [
        *common, f"model.name={args.from_model}", f"rollout.backend={'hf' if args.self_play else 'random'}",
        f"rollout.random_actions=[{args.actions[0]},{args.actions[1]}]", f"rollout.random_reasoning={args.reasoning}",
        f"rollout.random_moves={args.moves}", f"rollout.groups={args.games}",
        "rollout.group_size=1", f"rollout.seed={args.train_seed}", f"generate.out={work}/trajectories.jsonl",
        "generate.resume=true", f"clean.data={work}/trajectories.jsonl", f"clean.out={work}/sft.jsonl",
        f"clean.unit={args.unit}", "clean.val_fraction=0", f"clean.base_prompt_fraction={args.base_prompt_fraction}",
    ])
    generate.run(data)
    cleaned = clean.run(data)
    started = time.perf_counter()
    trained = sft.run(load_config(None, [
        *common, f"model.name={args.from_model}", f"sft.data={work}/sft.jsonl", f"sft.out={work}/sft",
        f"sft.epochs={args.epochs}", f"sft.global_batch={args.global_batch}", f"sft.lr={args.lr}", "sft.resume=true",
    ]))
    sft_seconds = time.perf_counter() - started
    metrics = [json.loads(line) for line in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    prior_tokens = sft_computed_tokens(Path(args.from_model).parent / "metrics.jsonl")
    points = []
    for epoch in sorted(set(args.eval_epochs or [args.epochs])):
        checkpoint = work / "sft" / f"epoch-{epoch}"
        figures = measure(args, common, checkpoint, "world_model", work / "eval" / f"epoch-{epoch}.json")
        # the prompt PPO and the eval arms use: does the format the SFT taught carry over to it?
        base = measure(args, common, checkpoint, "base", work / "eval" / f"epoch-{epoch}-base-prompt.json")
        wm = figures["world_model"]
        trajectories = work / "eval" / f"epoch-{epoch}.trajectories.jsonl"
        upto = [m for m in metrics if m["epoch"] <= epoch]
        point = {
            "name": name, "env": args.env, "games": args.games, "actions": list(args.actions), "turns": args.turns,
            "unit": args.unit, "reasoning": args.reasoning, "moves": args.moves, "base_prompt_fraction": args.base_prompt_fraction,
            "self_play": args.self_play, "from_model": args.from_model, "epoch": epoch,
            "epochs": args.epochs, "rows": cleaned["train_rows"], "lr": args.lr, "global_batch": args.global_batch,
            "sft_tokens": sum(m["tokens"] for m in upto), "sft_computed_tokens": computed_tokens(upto),
            "prior_sft_computed_tokens": prior_tokens,
            "sft_seconds": round(sum(m["seconds"] for m in upto), 1), "sft_wall_s": round(sft_seconds, 1),
            "train_loss": upto[-1]["loss"], "format_valid": figures["format_valid_rate"],
            "observation_exact": wm["observation"]["exact_match"], "prediction_exact": wm["prediction"]["exact_match"],
            "prediction_of_change_exact": wm["prediction_of_change"]["exact_match"],
            "prediction_of_change_turns": wm["prediction_of_change"]["turns"],
            "prediction_cells": wm["prediction"]["cell_accuracy"], "observation_cells": wm["observation"]["cell_accuracy"],
            "success": figures["pass@1"], "eval_turns": sum(t["turns"] for t in wm["per_turn"]),
            "base_prompt_format_valid": base["format_valid_rate"], "base_prompt_success": base["pass@1"],
            "prediction_errors": prediction_errors(trajectories) if args.env == "sokoban" else None,
            "prediction_ceiling": prediction_ceiling(trajectories).get("all") if args.env == "frozen_lake" else None,
            "eval_seeds": args.eval_seeds, "tuning_seed": args.tuning_seed, "final": trained.get("final"),
        }
        points.append(point)
        with Path(args.results).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(point) + "\n")
        print(json.dumps(point), flush=True)
    return points


def measure(args: argparse.Namespace, common: list[str], checkpoint: Path, prompt_mode: str, out: Path) -> dict:
    """One sample of each tuning room with this prompt: the eval report's metrics."""
    from stages import evaluate
    from stages.common.config import load_config

    return evaluate.run(load_config(None, [
        *common, f"model.name={checkpoint}", f"eval.prompt_mode={prompt_mode}", f"eval.seeds={args.eval_seeds}",
        f"eval.first_seed={args.tuning_seed}", "eval.pass_k=1", f"eval.out={out}", "eval.resume=true",
    ]))["metrics"]


def computed_tokens(metrics: list[dict]) -> int:
    """Tokens the SFT steps computed (merged turn rows compute fewer than they train; older
    metrics record only `tokens`)."""
    return sum(m.get("computed_tokens", m["tokens"]) for m in metrics)


def sft_computed_tokens(metrics: Path) -> int:
    """Tokens an earlier `spa sft` run computed (0 for a model that none of ours trained): a point
    that starts from one (a self-play round) has cost them too."""
    if not metrics.is_file():
        return 0
    return computed_tokens([json.loads(line) for line in metrics.read_text().splitlines()])


#: What a one-action Sokoban prediction can be, checked in this order (`prediction_error`).
ERROR_KINDS = ("exact", "another_action", "coordinates_wrong", "another_actions_grid", "misshapen_grid",
               "wrong_grid")


def prediction_errors(trajectories: Path) -> dict[str, int]:
    """The predictions of a Sokoban eval's episodes (`<eval out>.trajectories.jsonl`) counted by
    kind: turns with a prediction and exactly one executed action (a longer turn's "other action"
    is not defined)."""
    from stages.common.artifacts import read_jsonl

    counts = dict.fromkeys(ERROR_KINDS, 0)
    for episode in read_jsonl(trajectories)[0]:
        for turn in episode["turns"]:
            if turn.get("prediction") is not None and len(turn["executed"]) == 1:
                counts[prediction_error(turn, episode.get("render_mode", "coords"))] += 1
    return counts


def prediction_error(turn: dict, render_mode: str) -> str:
    """One kind of ERROR_KINDS: the true next state ("exact"); the true next state of an action
    other than the one answered ("another_action": it predicted one move and answered another);
    the true grid with wrong coordinates; another action's grid; a grid whose rows are not the
    room's in number or length; a room-shaped grid with wrong cells."""
    from envs.sokoban import SokobanEnv
    from stages.agent.states import grid_cells, states_match

    predicted = turn["prediction"]
    if states_match(predicted, turn["next_state"]):
        return "exact"
    room = grid_cells(turn["state"])
    room_text = "\n".join("".join(row) for row in room)

    def after(action: str) -> str:
        env = SokobanEnv.from_grid(room_text, render_mode=render_mode)
        env.step(action)
        return env.render()

    others = [after(action) for action in SokobanEnv.action_names if action != turn["executed"][0]]
    if any(states_match(predicted, state) for state in others):
        return "another_action"
    grid = grid_cells(predicted)
    if grid == grid_cells(turn["next_state"]):
        return "coordinates_wrong"
    if any(grid == grid_cells(state) for state in others):
        return "another_actions_grid"
    return "misshapen_grid" if [len(row) for row in grid] != [len(row) for row in room] else "wrong_grid"


def prediction_ceiling(trajectories: Path) -> dict[str, dict[str, float]]:
    """What any world model could score on a FrozenLake eval's turns (`<eval out>.trajectories.jsonl`):
    slippery ice makes a turn's next state random, so the best prediction is its most likely state,
    exact with that state's probability, and a model that has learnt the true distribution and
    samples from it (temperature 1, as the evals do) is exact with the sum of the squared
    probabilities. By the number of actions executed in the turn, and over all turns: the turns,
    the model's exact predictions, and those two expected rates (percent)."""
    from stages.agent.states import states_match
    from stages.common.artifacts import read_jsonl

    found: dict[int, list[tuple[bool, list[float]]]] = {}
    for episode in read_jsonl(trajectories)[0]:
        for turn in episode["turns"]:
            if turn.get("prediction") is not None and turn["executed"]:
                exact = states_match(turn["prediction"], turn["next_state"])
                found.setdefault(len(turn["executed"]), []).append((exact, outcome_chances(turn)))

    def percent(values: list[float]) -> float:
        return 100 * sum(values) / len(values)

    def rates(rows: list[tuple[bool, list[float]]]) -> dict[str, float]:
        return {"turns": len(rows), "model_exact": percent([exact for exact, _ in rows]),
                "best_possible": percent([max(chances) for _, chances in rows]),
                "true_distribution_sampled": percent([sum(p * p for p in chances) for _, chances in rows])}

    by_actions = {str(actions): rates(rows) for actions, rows in sorted(found.items())}
    return by_actions | ({"all": rates([row for rows in found.values() for row in rows])} if found else {})


def outcome_chances(turn: dict) -> list[float]:
    """The probabilities of the cells a FrozenLake turn's executed actions can end on, from the
    cell its state shows (holes and the goal end the walk: `transitions` keeps them)."""
    from envs.frozen_lake import FrozenLakeEnv
    from stages.agent.states import grid_cells

    env = FrozenLakeEnv.from_grid("\n".join("".join(row) for row in grid_cells(turn["state"])))
    where = {env.player: 1.0}
    for action in turn["executed"]:
        after: dict[tuple[int, int], float] = {}
        for cell, chance in where.items():
            for p, nxt in env.transitions(cell, env.action_names.index(action)):
                after[nxt] = after.get(nxt, 0.0) + chance * p
        where = after
    return list(where.values())


def plot(results: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    figure, axes = plt.subplots(1, 3, figsize=(19, 4))
    for ax, key, label in ((axes[0], "prediction_exact", "exact predictions (%)"),
                           (axes[1], "prediction_of_change_exact", "exact predictions, state changed (%)"),
                           (axes[2], "observation_exact", "exact observations (%)")):
        series: dict[str, list[dict]] = {}
        for point in points:
            series.setdefault(point["name"], []).append(point)
        for index, (name, run) in enumerate(sorted(series.items())):
            # the same color for a run in every panel; a point without the figure (recorded
            # before it existed, its episodes since deleted) is left out of that panel
            run = sorted((p for p in run if p.get(key) is not None), key=lambda p: p["epoch"])
            if not run:
                continue
            cost = [(p.get("prior_sft_computed_tokens", 0) + p["sft_computed_tokens"]) / 1000 for p in run]
            ax.plot(cost, [100 * (p[key] or 0) for p in run], marker="o", label=name,
                    color=plt.get_cmap("tab20")(index % 20))  # more runs than the default cycle's 10 colors
        ax.set(xlabel="SFT tokens computed (thousands)", ylabel=label, ylim=(0, 100))
        ax.grid(alpha=0.3)
    # beside the axes: inside them the points' names covered the high points
    axes[2].legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--games", type=int, default=64)
    parser.add_argument("--actions", type=int, nargs=2, default=(1, 1), metavar=("MIN", "MAX"))
    parser.add_argument("--turns", type=int, default=2, help="turns a game (the demo plays 2)")
    parser.add_argument("--unit", choices=("trajectory", "turn"), default="trajectory")
    parser.add_argument("--reasoning", choices=("fixed", "actions"), default="fixed",
                        help="RandSFT's reasoning: the paper's fixed sentence, or that sentence naming the actions")
    parser.add_argument("--moves", choices=("any", "effective"), default="any",
                        help="RandSFT's moves: uniform (the paper's), or uniform over those that change the state")
    parser.add_argument("--base-prompt-fraction", type=float, default=0.0,
                        help="share of the games whose SFT rows show the base prompt (clean.base_prompt_fraction)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-epochs", type=int, nargs="*", help="checkpoints to evaluate (default: the last)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--eval-seeds", type=int, default=64)
    parser.add_argument("--train-seed", type=int, default=10000)
    parser.add_argument("--tuning-seed", type=int, default=20000,
                        help="first seed of the rooms measured: held out from training and from the eval seeds 123..")
    parser.add_argument("--from-model", default="smollm2-135m")
    parser.add_argument("--self-play", action="store_true", help="the model plays (hf backend) instead of random actions")
    parser.add_argument("--name")
    parser.add_argument("--work", default=str(ROOT / "runs" / "wm_curve"))
    parser.add_argument("--results", default=str(DEFAULT_RESULTS))
    parser.add_argument("--plot", type=Path, help="draw the results file into this PNG and exit")
    parser.add_argument("--errors", type=Path, metavar="TRAJECTORIES",
                        help="print the prediction errors by kind of a Sokoban eval's trajectories file and exit")
    parser.add_argument("--ceiling", type=Path, metavar="TRAJECTORIES",
                        help="print the exact predictions of a FrozenLake eval's trajectories file beside the best "
                             "any world model could expect on the same turns (slippery ice), and exit")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.plot:
        return plot(Path(args.results), args.plot)
    if args.errors:
        return print(json.dumps(prediction_errors(args.errors)))
    if args.ceiling:
        return print(json.dumps(prediction_ceiling(args.ceiling), indent=1))
    run_point(args)


if __name__ == "__main__":
    main()

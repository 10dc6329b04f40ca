"""`spa clean`: trajectories.jsonl -> SFT rows with the true states filled in (SPA's
`generate_sft_data.py`).

Ground-truth replacement, as SPA's `convert_to_sft_format_add_worldmodel`: in assistant turn t,
the content of every `<observation>…</observation>` becomes the state text shown in that turn's
user message (`turns[t].state`), and the content of every `<prediction>…</prediction>` the state
after all the actions that turn executed (`turns[t].next_state`; the same as the observation when
nothing ran, and the realised state for slippery FrozenLake). The reasoning and the answer stay
verbatim. Earlier assistant turns in a row's context carry the true states too.

Options (`clean.*`):

* `states: self_belief` keeps the model's own states (the paper's Table 3 ablation).
* `random_coordinates` is the Fig. 5 ablation ("replaced all ground-truth (x, y) coordinates with
  i.i.d. random coordinates drawn from the same grid at each step", §4.2, "Effect of ground
  truth"). What is randomised is exactly what the ground-truth replacement writes: every "(r,c)"
  inside the substituted `<observation>` and `<prediction>` contents of the assistant messages
  (the trained turns and the history), so the model is trained to write wrong coordinates in the
  right format. The prompt is not touched: the user messages keep the states the game showed, and
  PPO and eval show true coordinates as ever. Why: the paper holds "the text template and
  training recipe fixed" and tests whether true coordinates in the supervision matter; the
  prompt is the environment's own render, which the recipe never rewrites. Draws: one per state
  (turn t's prediction and turn t+1's observation stay equal), each number uniform from the
  smallest to the largest coordinate number seen in that env's states in the input (our reading
  of "the same grid": the cells the items occupy).
* `filter_format`: a turn is trained only when the agent loop parsed its answer and executed it
  (the turn's `format_ok`, the strict parse of the prompt mode it was played in) and it passes
  SPA's `filter_sft_by_tag.py` check (`parsing.well_formed`: think before answer, and in
  world-model mode an observation before a prediction inside think). The first matters: SPA's check
  alone passes a turn with text between `</prediction>` and `</think>`, whose actions the strict
  parser never ran, and the ground-truth replacement would then teach "prediction = observation"
  under an answer that moves. A failing turn is kept as context with `"train": false` in trajectory
  rows, and dropped in turn rows.
* `base_prompt_fraction` (not SPA's; 0 by default): that share of the world-model trajectories (a
  seeded draw) is shown with the base prompt instead, the game's base instruction and format
  line, while their assistant turns keep the observation and prediction. SPA's PPO and its eval
  arms prompt the SFT model with the base prompt and rely on it writing its format there too
  (the base parser accepts the states inside `<think>`); a 1.5B model does, the bundled 135M one
  trained on world-model prompts alone mostly does not (docs/experiments.md). The
  masked-state control gets the same rows with its states masked, so the two still differ only
  in the states.
* `dedup`: rows with identical messages (and loss flags) are kept once.
* `success_only`: keep successful episodes only (SPA has this filter commented out).
* The train/validation split is by trajectory (`val_fraction`, seeded), so no episode has turns on
  both sides; SPA splits rows, which lets turns of one episode land in both. Output:
  `clean.out` and `artifacts.val_path(clean.out)`.
* `recipe: spa` replaces the three above by the data recipe of SPA's release, per game (its
  README and `sft/filter_sft_by_tag.py`): the Sokoban data is raw self-play, every turn trained
  and nothing de-duplicated; the FrozenLake and Sudoku data (and any other game's here) went
  through the tag check alone (`parsing.well_formed`, no `format_ok`) and its de-duplication. Rows
  are SPA's one per turn, and 20% of them, rounded up, are held out by a seeded shuffle of the rows
  (`train_test_split(test_size=0.2)`; the permutation is ours, not scikit-learn's), so turns of
  one episode can land on both sides. Those are the rows SPA trained its released checkpoints on;
  the strict recipe is the default because each of its three steps removes rows that teach the
  wrong thing (docs/paper.md).

SPA's released data (`wm_train.parquet`, or a hub dataset id; `stages.common.spa_data`) is read
too: its rows already carry ground-truth states and are one row per turn, so `clean` keeps them as
turn rows, applies SPA's tag check (`filter_format`; there is no turn record, so no `format_ok`),
`dedup` and the split (by puzzle: rows whose first user message is the same go together), and
writes our JSONL; `states`, `random_coordinates` and `success_only` need trajectories and are
refused. Under `recipe: spa` the released rows are taken as they are, with the release's own
train/validation files.

Rows (what `spa sft` reads)::

    {"id", "source_id", "env", "seed", "success",
     "messages": [{"role", "content"} ... assistant messages also have "train": true|false]}

`unit: trajectory` gives one row per episode with every (well-formed) assistant message trained;
`unit: turn` gives SPA's one row per assistant turn: the prior chat as context, the turn trained.
The two give the same loss terms; the first is several times cheaper to train on.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.agent.env_manager import make_env
from stages.agent.parsing import replace_states, well_formed
from stages.agent.prompts import as_base_prompt
from stages.common import artifacts, distributed, spa_data
from stages.common.config import CleanConfig, SPAConfig, to_dict
from stages.common.console import Console
from stages.common.errors import UserError

_COORDINATE = re.compile(r"\((\d+),(\s*)(\d+)\)")

REQUIRED = ("id", "messages", "turns")


def run(config: SPAConfig) -> dict[str, Any]:
    """Clean `clean.data` into `clean.out` (+ its .val file); return and print the counts."""
    distributed.require_one_process("clean", "run it without torchrun / deepspeed (it takes seconds)")
    options = config.clean
    check_options(config)
    data, spa_val = spa_data.locate(options.data)
    if spa_data.is_parquet(data):
        rows, val_rows = spa_data.read_rows(data), spa_data.read_rows(spa_val) if spa_val is not None else []
        result, bad_lines = clean_spa_rows(rows, val_rows, config), 0
        rows = rows + val_rows  # a new list: result.train may be the first
    else:
        rows, bad_lines = artifacts.read_jsonl(data, skip_bad=options.skip_bad, required=REQUIRED,
                                               fix="fix or delete that line, or add --skip-bad to skip such lines")
        if not rows and not bad_lines:
            raise UserError(f"{options.data} holds no trajectories; write it with `spa generate` (or check the path)")
        result = clean_trajectories(rows, config)
        if rows and result.dropped_trajectories["malformed"] == len(rows):
            raise UserError(f"no line of {options.data} is a trajectory (line 1: {trajectory_problem(rows[0])}); "
                            "write it with `spa generate`")
    result.dropped_trajectories["bad_line"] = bad_lines

    out = Path(options.out)
    val_out = artifacts.val_path(out)
    artifacts.write_jsonl_files({out: result.train, val_out: result.val})
    summary = {
        "data": options.data, "out": str(out), "val_out": str(val_out),
        "trajectories": len(rows) + bad_lines,
        "rows": len(result.train) + len(result.val),
        "train_rows": len(result.train),
        "val_rows": len(result.val),
        "unit": result.unit,
        "dropped_trajectories": dict(result.dropped_trajectories),
        "dropped_rows": dict(result.dropped_rows),
        "untrained_turns": result.untrained_turns,
    }
    inputs = {"data": data, **({"val_data": spa_val} if spa_val is not None else {})}  # a hub id's files
    artifacts.write_manifest(out, {**artifacts.manifest("clean", to_dict(config), inputs),
                                   "summary": summary})
    print_summary(summary, Console(config.quiet))
    return summary


def check_options(config: SPAConfig) -> None:
    options = config.clean
    if not 0 <= options.val_fraction < 1:
        raise UserError(f"clean.val_fraction must be in [0, 1), got {options.val_fraction}")
    if options.random_coordinates and options.states != "ground_truth":
        raise UserError("clean.random_coordinates rewrites the substituted states; it needs "
                        "clean.states=ground_truth")
    if spa_data.is_parquet(options.data) or spa_data.is_hub_dataset(options.data):
        chosen = [f"clean.{name}" for name, on in (("states=self_belief", options.states != "ground_truth"),
                                                   ("random_coordinates", options.random_coordinates),
                                                   ("base_prompt_fraction", options.base_prompt_fraction > 0),
                                                   ("success_only", options.success_only)) if on]
        if chosen:
            raise UserError(f"{', '.join(chosen)} needs trajectories from `spa generate`; SPA's released rows "
                            "carry their states already; leave it out for this data")
    else:
        check_recipe(options)
    if Path(options.out).is_dir():
        raise UserError(f"clean.out ({options.out}) is a directory; give a .jsonl file path")
    if Path(options.out).resolve() == Path(options.data).resolve():
        raise UserError(f"clean.out ({options.out}) would overwrite the input; choose another path")
    artifacts.check_writable(options.out)


def check_recipe(options: CleanConfig) -> None:
    """The recipe's own needs (`spa pipeline` checks them before any stage runs)."""
    if options.recipe == "spa" and options.unit != "turn":
        raise UserError("clean.recipe=spa makes SPA's rows, one per turn split by row; set clean.unit=turn")


@dataclass
class CleanResult:
    train: list[dict]
    val: list[dict]
    dropped_trajectories: Counter
    dropped_rows: Counter
    untrained_turns: int
    unit: str


def clean_trajectories(trajectories: list[dict], config: SPAConfig) -> CleanResult:
    """The whole stage on rows in memory: replacement, filters, rows, dedup, split."""
    options = config.clean
    dropped_trajectories: Counter = Counter({"malformed": 0, "not_success": 0})
    dropped_rows: Counter = Counter({"format": 0, "duplicate": 0})
    coordinates = None
    if options.random_coordinates:  # coordinate ranges from the trajectories that can be cleaned only
        cleanable = [t for t in trajectories if trajectory_problem(t) is None]
        coordinates = _CoordinateRandomizer(cleanable, options.seed)
    shown_base = base_prompt_ids(trajectories, options.base_prompt_fraction, options.seed)
    games: dict[str, Any] = {}  # per render mode, for the base prompt's texts
    rows: list[dict] = []
    for trajectory in trajectories:
        problem = trajectory_problem(trajectory)
        if problem is not None:
            dropped_trajectories["malformed"] += 1
            continue
        if options.success_only and not trajectory.get("success"):
            dropped_trajectories["not_success"] += 1
            continue
        messages = substitute_states(trajectory, options.states, coordinates)
        trained = _trained_flags(messages, trajectory, format_check(trajectory, config))
        if trajectory["id"] in shown_base:
            messages = with_base_prompt(trajectory, messages, config, games)
        if options.unit == "trajectory":
            row = trajectory_row(trajectory, messages, trained)
            if row is None:
                dropped_rows["format"] += 1
            else:
                rows.append(row)
        else:
            dropped_rows["format"] += sum(not flag for flag in trained)
            rows.extend(turn_rows(trajectory, messages, trained))
    if options.recipe == "spa":
        rows, dropped_rows["duplicate"] = deduplicate(rows, only=lambda row: spa_filters(row["env"] or config.env.name))
        train, val = split_rows(rows, SPA_VAL_FRACTION, options.seed)
    else:
        if options.dedup:
            rows, dropped_rows["duplicate"] = deduplicate(rows)
        train, val = split_by_trajectory(rows, options.val_fraction, options.seed)
    # Malformed turns kept as context of a trajectory row (in turn rows only the last message trains).
    untrained = 0 if options.unit == "turn" else sum(
        m["role"] == "assistant" and not m["train"] for row in rows for m in row["messages"])
    return CleanResult(train, val, dropped_trajectories, dropped_rows, untrained, options.unit)


def base_prompt_ids(trajectories: list[dict], fraction: float, seed: int) -> set[str]:
    """The trajectories shown with the base prompt: round(fraction x n) of the n cleanable
    world-model ones, a seeded draw."""
    ids = sorted(t["id"] for t in trajectories
                 if trajectory_problem(t) is None and t.get("prompt_mode", "world_model") == "world_model")
    random.Random(f"{seed}-base-prompt").shuffle(ids)
    return set(ids[:round(len(ids) * fraction)])


def with_base_prompt(trajectory: dict, messages: list[dict], config: SPAConfig, games: dict[str, Any]) -> list[dict]:
    """The trajectory's messages under the base prompt of the configured game (built once per
    render mode into `games`)."""
    render_mode = trajectory.get("render_mode", "coords")
    if render_mode not in games:
        games[render_mode] = make_env(config.env, render_mode)
    rewritten = as_base_prompt(messages, games[render_mode])
    if rewritten is None:
        raise UserError(f"clean.base_prompt_fraction: trajectory {trajectory['id']} does not start with the "
                        f"world-model instruction of env {config.env.name!r} (options {config.env.options}); "
                        "clean it with the env settings it was played with")
    return rewritten


def clean_spa_rows(rows: list[dict], val_rows: list[dict], config: SPAConfig) -> CleanResult:
    """SPA's released rows (one per turn, states already true) and its held-out ones: under the
    strict recipe its tag check on the trained turn, dedup, and a split of both by puzzle
    (`source_id`); under `recipe: spa` the two as released."""
    options = config.clean
    dropped_rows: Counter = Counter({"format": 0, "duplicate": 0})
    if options.recipe == "spa":
        return CleanResult(rows, val_rows, Counter({"malformed": 0, "not_success": 0}), dropped_rows, 0, "turn")
    rows = rows + val_rows
    kept = [row for row in rows
            if not options.filter_format or well_formed(row["messages"][-1]["content"], "world_model")]
    dropped_rows["format"] = len(rows) - len(kept)
    if options.dedup:
        kept, dropped_rows["duplicate"] = deduplicate(kept)
    train, val = split_by_trajectory(kept, options.val_fraction, options.seed)
    return CleanResult(train, val, Counter({"malformed": 0, "not_success": 0}), dropped_rows, 0, "turn")


def trajectory_problem(trajectory: dict) -> str | None:
    """Why a trajectory line cannot be cleaned (None if it can): one assistant message per turn."""
    if not isinstance(trajectory.get("id"), str):
        return "id must be a string"
    messages, turns = trajectory.get("messages"), trajectory.get("turns")
    if not isinstance(messages, list) or not isinstance(turns, list):
        return "messages and turns must be lists"
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return "a message without text content"
    assistants = sum(m.get("role") == "assistant" for m in messages)
    if assistants != len(turns) or not turns:
        return f"{assistants} assistant messages for {len(turns)} turns"
    texts = (t.get(key) if isinstance(t, dict) else None for t in turns for key in ("state", "next_state"))
    if not all(isinstance(text, str) for text in texts):
        return "a turn without state text"
    return None


# ---- ground-truth replacement ----------------------------------------------------------------------


def substitute_states(trajectory: dict, states: str = "ground_truth",
                      coordinates: _CoordinateRandomizer | None = None) -> list[dict[str, str]]:
    """The trajectory's messages with assistant turn t's states replaced (every occurrence)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in trajectory["messages"]]
    if states == "self_belief":
        return messages
    turns = trajectory["turns"]
    t = 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        observation, prediction = turns[t]["state"], turns[t]["next_state"]
        if coordinates is not None:
            observation = coordinates.rewrite(trajectory, t, observation)
            prediction = coordinates.rewrite(trajectory, t + 1, prediction)
        message["content"] = replace_states(message["content"], observation, prediction)
        t += 1
    return messages


class _CoordinateRandomizer:
    """Random coordinates in the states' own "(r,c)" format, one draw per state of a trajectory."""

    def __init__(self, trajectories: list[dict], seed: int):
        self.seed = seed
        numbers: dict[str, list[int]] = {}
        for trajectory in trajectories:
            for turn in trajectory.get("turns") or []:
                for text in (turn.get("state"), turn.get("next_state")) if isinstance(turn, dict) else ():
                    if isinstance(text, str):
                        found = numbers.setdefault(str(trajectory.get("env")), [])
                        for match in _COORDINATE.finditer(text):
                            found += [int(match.group(1)), int(match.group(3))]
        self.ranges = {env: (min(found), max(found)) for env, found in numbers.items() if found}

    def rewrite(self, trajectory: dict, index: int, state: str) -> str:
        """State number `index` of the trajectory (0 is the first observation) with random coordinates."""
        low, high = self.ranges.get(str(trajectory.get("env")), (0, 0))
        rng = random.Random(f"{self.seed}-{trajectory['id']}-{index}")
        def draw(match: re.Match[str]) -> str:
            return f"({rng.randint(low, high)},{match.group(2)}{rng.randint(low, high)})"
        return _COORDINATE.sub(draw, state)


# ---- rows ------------------------------------------------------------------------------------------


#: The fraction of rows SPA's `generate_sft_data.py` holds out (`train_test_split(test_size=0.2)`).
SPA_VAL_FRACTION = 0.2
#: The games whose released SFT data SPA trains on unfiltered (its README: "the Sokoban dataset is
#: unfiltered"); its FrozenLake and Sudoku data went through `filter_sft_by_tag.py`.
SPA_UNFILTERED_GAMES = ("sokoban",)


def spa_filters(env: str | None) -> bool:
    """Does SPA's recipe filter (tag check and dedup) this game's data? (Sokoban's variants too.)"""
    return not str(env).startswith(SPA_UNFILTERED_GAMES)


def format_check(trajectory: dict, config: SPAConfig) -> str:
    """The check a trajectory's turns must pass to be trained: "strict" (parsed and executed, and
    SPA's tag check), "tags" (SPA's tag check alone) or "none"."""
    options = config.clean
    if options.recipe == "spa":
        return "tags" if spa_filters(trajectory.get("env") or config.env.name) else "none"
    return "strict" if options.filter_format else "none"


def _trained_flags(messages: list[dict], trajectory: dict, check: str) -> list[bool]:
    """One flag per assistant message: does it pass `check` (`format_check`)."""
    mode = trajectory.get("prompt_mode", "world_model")
    assistants = [m["content"] for m in messages if m["role"] == "assistant"]
    parsed = [turn.get("format_ok") is True for turn in trajectory["turns"]]
    return [check == "none" or ((ok or check == "tags") and well_formed(content, mode))
            for content, ok in zip(assistants, parsed)]


def _row(trajectory: dict, row_id: str, messages: list[dict]) -> dict:
    return {"id": row_id, "source_id": trajectory["id"], "env": trajectory.get("env"),
            "seed": trajectory.get("seed"), "success": bool(trajectory.get("success")), "messages": messages}


def _with_flags(messages: list[dict], trained: list[bool], upto: int | None = None) -> list[dict]:
    """Messages with "train" on assistant ones: `trained[t]`, or only turn `upto` if given."""
    out, t = [], 0
    for message in messages:
        if message["role"] == "assistant":
            flag = trained[t] if upto is None else t == upto
            out.append({**message, "train": flag})
            t += 1
        else:
            out.append(dict(message))
    return out


def trajectory_row(trajectory: dict, messages: list[dict], trained: list[bool]) -> dict | None:
    """One row for the episode, every passing assistant message trained; None if none passes."""
    if not any(trained):
        return None
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _row(trajectory, trajectory["id"], _with_flags(messages[:last + 1], trained))


def turn_rows(trajectory: dict, messages: list[dict], trained: list[bool]) -> list[dict]:
    """SPA's rows: for each passing assistant turn t, the chat up to it with only turn t trained."""
    rows, t = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if trained[t]:
            row_id = f"{trajectory['id']}-turn{t + 1}"
            rows.append(_row(trajectory, row_id, _with_flags(messages[:i + 1], trained, t)))
        t += 1
    return rows


def deduplicate(rows: list[dict], only: Callable[[dict], bool] = lambda row: True) -> tuple[list[dict], int]:
    """Rows with the same messages (content and loss flags) kept once, the first one; rows for
    which `only` is false are all kept."""
    seen: set[str] = set()
    kept = []
    for row in rows:
        if not only(row):
            kept.append(row)
            continue
        key = json.dumps(row["messages"], ensure_ascii=False, sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept, len(rows) - len(kept)


def split_by_trajectory(rows: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded split of the source trajectories; every row follows its trajectory."""
    sources = sorted({row["source_id"] for row in rows})
    random.Random(seed).shuffle(sources)
    val_sources = set(sources[:round(len(sources) * val_fraction)])
    train = [row for row in rows if row["source_id"] not in val_sources]
    val = [row for row in rows if row["source_id"] in val_sources]
    return train, val


def split_rows(rows: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """SPA's split: a seeded shuffle of the rows themselves, ceil(val_fraction x n) held out (as
    scikit-learn's train_test_split rounds); both sides keep the rows' order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held_out = set(order[:math.ceil(len(rows) * val_fraction)])
    return ([row for i, row in enumerate(rows) if i not in held_out],
            [row for i, row in enumerate(rows) if i in held_out])


def print_summary(summary: dict[str, Any], console: Console) -> None:
    dropped = {**summary["dropped_trajectories"], **{f"{k} ({summary['unit']} rows)": v
                                                     for k, v in summary["dropped_rows"].items()}}
    console.result(f"clean: kept {summary['rows']} {summary['unit']} rows (train {summary['train_rows']}, "
                   f"val {summary['val_rows']}) from {summary['trajectories']} trajectories -> {summary['out']}; "
                   "dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    if summary["unit"] == "trajectory" and summary["untrained_turns"]:
        console.result(f"clean: {summary['untrained_turns']} malformed turns kept as context without loss")
    if summary["rows"] == 0:
        console.result(f"clean: warning: no rows kept; {no_rows_cause(summary)}")


def no_rows_cause(summary: dict[str, Any]) -> str:
    """Why a clean kept no row, and what to do, from its counts (the filter that dropped the last
    trajectories speaks first)."""
    dropped = summary["dropped_trajectories"]
    read = summary["trajectories"] - dropped.get("bad_line", 0) - dropped.get("malformed", 0)
    if read == 0:
        return f"every line of {summary['data']} was unreadable and skipped (--skip-bad); check the file"
    if dropped.get("not_success") and dropped["not_success"] == read:
        return (f"--success-only kept nothing: none of the {read} trajectories succeeded (drop --success-only, "
                "or generate more episodes)")
    return ("the format filter dropped every turn: a model that never writes the format gives no data "
            "(bootstrap with the random backend, or --set clean.filter_format=false)")

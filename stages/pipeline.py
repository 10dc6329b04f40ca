"""`spa pipeline`: the paper's comparison as arms of one run directory, resumable and incremental.

An arm is one row of the paper's tables: a model it starts from, what it trains (world-model SFT,
PPO, both, neither) and how it is evaluated. `pipeline.arms` lists them, in the order of the table;
each is a built-in name below or a mapping that defines a variant (see `Arm`, docs/cli.md
"spa pipeline"). The built-in arms (reference notes §7.3, §7.5):

    name                     row of the paper                  SFT data (world-model prompt)  SFT        PPO (prompt, states)        eval
    base                     base model (Table 2)              -                              -          -                           base, raw grid
    state_estimation         + State Estimation (Table 7)      -                              -          -                           base, coordinates
    vanilla_rl               + Vanilla RL                      -                              -          base, raw grid              as PPO
    state_estimation_rl      + State Estimation RL             -                              -          base, coordinates           as PPO
    vagen                    + VAGEN                           -                              -          world model, coordinates,   as PPO
                                                                                                         + reward for right states,
                                                                                                         bi-level GAE
    spa_sft                  + SPA SFT (Table 7)               self-play, coordinates         5 epochs   -                           base, coordinates
    spa                      + SPA                             as spa_sft                     as spa_sft base, coordinates           as PPO
    spa_masked               masked states (Fig. 4)            as spa                         [MASKED]   as spa                      as PPO
    spa_random_coordinates   random coordinates (Fig. 5)       as spa, random coordinates     as spa     as spa                      as PPO
    spa_no_state_estimation  SPA w/o State Estimation (Tab. 4) self-play, raw grid            as spa     base, raw grid              as PPO
    spa_self_belief          self-belief states (Table 3)      as spa, the model's own states as spa     as spa                      as PPO
    rand_sft                 RandSFT (Table 5)                 random actions                 as spa     as spa                      as PPO
    spa_sft_1_epoch          1-epoch SFT (Table 5)             as spa                         1 epoch    as spa                      as PPO
    spa_unfiltered           raw data (Fig. 8)                 as spa, no format filter       as spa     as spa                      as PPO

"As PPO": an arm is evaluated with the prompt and render mode it was trained with, as the paper
validates its RL runs; everything else about the eval (puzzles, samples, temperature, tokens,
turns) is the same for every arm, so the paired differences of the table are over the same puzzles.
A built-in arm pins what defines it (the prompt and render modes in this table, VAGEN's state
reward and bi-level GAE, the state reward's absence elsewhere, the ablation's own setting); every
other setting comes from the config's sections (`sft.epochs`, `ppo.steps`, ...), the same for
every arm.
The self-play data is played by the arm's starting model (`pipeline.data_policy: model`, the
paper), or by random actions (`random`, the bootstrap for a model too weak to write the format, in
which case spa's data is RandSFT data). A mapping defines an arm from a built-in one (`like`) with
other settings (`set`: dotted keys of generate, clean, sft, ppo, eval), another starting `model`
(a checkpoint, e.g. one of SPA's released ones), another game to train on (`train_env`: its SFT
data and PPO; the eval still plays the pipeline's `env`, so every row of the table is measured on
one game, and the arm is tested zero-shot: Table 6), its SFT data alone played on another game
(`data_env`: Easy2Hard, Fig. 9), or an SFT file instead of played data (`sft_data`: our JSONL,
SPA's parquet, a hub dataset id).

The paper plays FrozenLake on 6x6 with Qwen2.5-3B and on 4x4 with the smaller models (§3); a
pipeline whose `env` is the 4x4 `frozen_lake` with a Qwen2.5-3B model is refused unless
`env.options.size` says the board on purpose (`PAPER_BOARDS`), so that `--set model.name=...` on a
1.5B config does not silently measure another table.

Stages. Every arm is a chain of stages: generate -> clean -> sft -> ppo -> eval (the ones it has),
and with `eval.probe_states` a probe of the model its eval plays, which asks every arm's model the
same questions (the pipeline's game and render mode), so arms that end in one model share it.
A stage that two arms share (spa_sft and spa share data, cleaning and SFT) runs once: two stages
are the same when they read the same settings from the same upstream stages. Each stage has an id
that names its output; a built-in arm's stages have fixed ids (spa's SFT is `sft/spa` whichever
arms are listed, in whatever order), a variant's stages keep their built-in arm's ids where they
equal its stages, and take the variant's name where they differ. Layout of `pipeline.dir`:

    data/<id>.jsonl              generate  self-play (or random-action) trajectories
    sft_data/<id>.jsonl          clean     SFT rows with the true states (+ .val.jsonl)
    sft/<id>/                    sft       world-model fine-tuning (final/ is the model)
    ppo/<id>/                    ppo       PPO (final/ is the model)
    eval/<id>.json               eval      the reports (+ .trajectories.jsonl)
    probe/<id>.json              probe     with `eval.probe_states`: `spa probe` of an arm's final model
                                           (+ .cases.jsonl), one per distinct model
    table.md                     the comparison, laid out like the paper's Table 2
    curves.png                   the training curves of sft/ and ppo/ (`spa plot`)
    pass_at_k.png                the Pass@k curves of the arms, with 95% bands
    ppo/<id>/val/pass_at_k.png   the Pass@k curves of a PPO run's validations (ppo.val_every), with 95% bands
    validation.png               validation Pass@1 against step of every PPO run validated twice or more, 95% bands
    pipeline_state.json          the stages completed, under which fingerprint, in how many seconds,
                                 with what peak resident memory (`stages.common.rss`)

A stage is skipped when it completed before with the same fingerprint: the config sections it
reads plus the hashes of its inputs. A stage that started but did not finish is resumed (every stage
resumes on its own); one whose settings or inputs changed since is started over (its old output is
removed first). Later stages see the new inputs' hashes, so they rerun too. `plan` checks every arm
and stage before anything runs or is written; `spa pipeline --dry-run` prints it, with each stage's
memory per GPU (`memory_plans`, sized from the arm's starting model, without the network); on a
GPU, `run` refuses, before the first stage, a pipeline one of whose stages would not fit.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages.agent.env_manager import check_modes
from stages.common import artifacts, distributed, rss, spa_data, tracking
from stages.common.config import EnvConfig, SPAConfig, from_dict, with_overrides
from stages.common.console import Console, duration
from stages.common.errors import UserError
from stages.common.models import check_model_name, model_shape, pick_device
from stages.training import engine, memory

STATE_FILE = "pipeline_state.json"
KINDS = ("generate", "clean", "sft", "ppo", "eval", "probe")
#: The config sections each kind of stage reads: its fingerprint, and what makes two stages one.
SECTIONS = {
    "generate": ("env", "model", "rollout", "generate"),
    "clean": ("env", "clean"),  # the env: its base prompt (clean.base_prompt_fraction)
    "sft": ("model", "sft"),
    "ppo": ("env", "model", "rollout", "ppo"),
    "eval": ("env", "model", "rollout", "eval"),
    "probe": ("env", "model"),  # and `PROBE_KEYS`
}
#: What a probe reads besides its game and model: the same for every arm (the pipeline's), so that
#: arms that end in the same model share its probe. Not part of the eval's fingerprint.
PROBE_KEYS = {"eval": ("probe_states", "render_mode"), "rollout": ("max_actions_per_traj",)}
#: What an arm's `set` may change: the settings of its own stages (the game it is evaluated on, the
#: model and rollout settings are the pipeline's, so that every arm is measured on the same game in
#: the same way; `train_env` is how an arm trains on another).
ARM_SECTIONS = ("generate", "clean", "sft", "ppo", "eval")
#: Rollout settings that only the random backend reads: part of the fingerprint of its stages alone,
#: so that changing how the RandSFT data is drawn does not rerun the arms that never read it.
RANDOM_BACKEND_KEYS = ("random_actions", "random_reasoning", "random_moves")
#: Keys the pipeline sets itself (paths, resuming).
PIPELINE_KEYS = ("out", "data", "val_data", "resume")
#: Eval settings an arm may have of its own; the rest is the same for every arm.
ARM_EVAL_KEYS = ("prompt_mode", "render_mode", "out", "resume")
#: Stands for a path that the upstream stage's id decides (replaced once ids are assigned).
CHAINED = "<upstream>"


# ---- arms ------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One row of the comparison. A mapping in `pipeline.arms` gives these keys (all but `name`
    optional), `like` naming the built-in arm it starts from."""

    name: str
    #: The row's text in table.md (default: the name).
    label: str = ""
    #: World-model SFT before anything else, on played data (or `sft_data`).
    sft: bool = False
    ppo: bool = False
    #: The model the arm starts from; "" is `model.name`.
    model: str = ""
    #: Who plays the SFT data: "" (`pipeline.data_policy`), "model" or "random" (RandSFT).
    data_policy: str = ""
    #: The game the arm trains on ({name, options}): its SFT data and its PPO; empty: the
    #: pipeline's `env`. The arm is evaluated on the pipeline's `env` whatever it trained on, so a
    #: table compares every arm on one game (zero-shot transfer when they differ: Table 6).
    train_env: dict[str, Any] = field(default_factory=dict)
    #: The game the SFT data is played on ({name, options}); empty: the game the arm trains on.
    data_env: dict[str, Any] = field(default_factory=dict)
    #: SFT on this file (our JSONL rows, SPA's parquet, a hub dataset id) instead of played data.
    sft_data: str = ""
    #: Dotted settings of the arm's stages ({"sft.epochs": 1, "ppo.render_mode": "text"}).
    set: dict[str, Any] = field(default_factory=dict)
    #: The built-in arm this one is defined from ("" for a built-in arm or one from scratch).
    like: str = ""
    #: A built-in arm's ids of its generate, clean and sft stages (shared ones share ids).
    ids: dict[str, str] = field(default_factory=dict)


_SELF_PLAY = {"generate": "selfplay", "clean": "selfplay", "sft": "spa"}
# What defines each built-in arm, pinned whatever the config's sections say: what the model is
# shown in each stage, and whether RL rewards states (the table above).
_SELF_PLAY_DATA = {"generate.prompt_mode": "world_model", "generate.render_mode": "coords"}
_STATE_ESTIMATION_RL = {"ppo.prompt_mode": "base", "ppo.render_mode": "coords", "ppo.state_reward": "none"}
_SPA = {**_SELF_PLAY_DATA, **_STATE_ESTIMATION_RL}

#: The built-in arms, in the order their stages are planned (so that shared stages keep their ids).
BUILT_IN = {arm.name: arm for arm in [
    Arm("base", "base model", set={"eval.prompt_mode": "base", "eval.render_mode": "text"}),
    Arm("state_estimation", "+ State Estimation", set={"eval.prompt_mode": "base", "eval.render_mode": "coords"}),
    Arm("vanilla_rl", "+ Vanilla RL", ppo=True, set={**_STATE_ESTIMATION_RL, "ppo.render_mode": "text"}),
    Arm("state_estimation_rl", "+ State Estimation RL", ppo=True, set=_STATE_ESTIMATION_RL),
    Arm("vagen", "+ VAGEN", ppo=True,
        set={"ppo.prompt_mode": "world_model", "ppo.render_mode": "coords", "ppo.state_reward": "cells",
             "ppo.advantage": "bilevel_gae"}),
    Arm("spa_sft", "+ SPA SFT", sft=True, ids=_SELF_PLAY,
        set={**_SELF_PLAY_DATA, "eval.prompt_mode": "base", "eval.render_mode": "coords"}),
    Arm("spa", "+ SPA", sft=True, ppo=True, ids=_SELF_PLAY, set=_SPA),
    Arm("spa_masked", "SPA, masked states (Fig. 4)", sft=True, ppo=True, set={**_SPA, "sft.state_text": "masked"},
        ids={**_SELF_PLAY, "sft": "spa_masked"}),
    Arm("spa_format_control", "SPA, placeholder states (format control)", sft=True, ppo=True,
        set={**_SPA, "sft.state_text": "placeholder"}, ids={**_SELF_PLAY, "sft": "spa_format_control"}),
    Arm("spa_random_coordinates", "SPA, random coordinates (Fig. 5)", sft=True, ppo=True,
        set={**_SPA, "clean.random_coordinates": True},
        ids={"generate": "selfplay", "clean": "selfplay_random_coordinates", "sft": "spa_random_coordinates"}),
    Arm("spa_no_state_estimation", "SPA without State Estimation (Table 4)", sft=True, ppo=True,
        set={**_SPA, "generate.render_mode": "text", "ppo.render_mode": "text"},
        ids={"generate": "selfplay_text", "clean": "selfplay_text", "sft": "spa_no_state_estimation"}),
    Arm("spa_self_belief", "SPA, self-belief states (Table 3)", sft=True, ppo=True,
        set={**_SPA, "clean.states": "self_belief"},
        ids={"generate": "selfplay", "clean": "selfplay_self_belief", "sft": "spa_self_belief"}),
    Arm("rand_sft", "RandSFT (Table 5)", sft=True, ppo=True, data_policy="random", set=_SPA,
        ids={"generate": "random", "clean": "random", "sft": "rand_sft"}),
    Arm("spa_sft_1_epoch", "SPA, 1-epoch SFT (Table 5)", sft=True, ppo=True, set={**_SPA, "sft.epochs": 1},
        ids={**_SELF_PLAY, "sft": "spa_sft_1_epoch"}),
    Arm("spa_unfiltered", "SPA, unfiltered data (Fig. 8)", sft=True, ppo=True,
        set={**_SPA, "clean.filter_format": False},
        ids={"generate": "selfplay", "clean": "selfplay_unfiltered", "sft": "spa_unfiltered"}),
]}

_ARM_KEYS = ("name", "like", "label", "sft", "ppo", "model", "data_policy", "train_env", "data_env", "sft_data",
             "set")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def arms(config: SPAConfig) -> list[Arm]:
    """The arms of `pipeline.arms`, in table order, each checked; a bad one is one UserError line."""
    found: list[Arm] = []
    for index, entry in enumerate(config.pipeline.arms):
        where = f"pipeline.arms[{index}]"
        arm = built_in(entry, where) if isinstance(entry, str) else _variant(entry, where)
        if any(other.name == arm.name for other in found):
            raise UserError(f"{where}: arm {arm.name!r} is listed twice; give the variant another name")
        found.append(arm)
    if not found:
        raise UserError("pipeline.arms is empty; list the arms to run, e.g. [base, spa]")
    return found


def built_in(name: str, where: str) -> Arm:
    if name not in BUILT_IN:
        close = difflib.get_close_matches(name, list(BUILT_IN), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{where}: unknown arm {name!r}; built-in arms: {', '.join(BUILT_IN)}, or a mapping "
                        f"{{name, like, set, ...}} that defines one.{hint}")
    return copy.deepcopy(BUILT_IN[name])


def _variant(entry: dict[str, Any], where: str) -> Arm:
    for key in entry:
        if key not in _ARM_KEYS:
            close = difflib.get_close_matches(str(key), _ARM_KEYS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{where}: unknown arm key {key!r}; keys: {', '.join(_ARM_KEYS)}.{hint}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserError(f"{where}: an arm needs a name of letters, digits, '_', '-' or '.', got {name!r}")
    if name in BUILT_IN:
        raise UserError(f"{where}: {name!r} is a built-in arm; give the variant another name")
    like = entry.get("like", "")
    if not isinstance(like, str):
        raise UserError(f"{where}.like must name a built-in arm, got {like!r}")
    arm = built_in(like, f"{where}.like") if like else Arm(name)
    # A variant's stages are named after it, except those equal to its built-in arm's (`plan`).
    arm.name, arm.label, arm.like, arm.ids = name, name, like, {}
    for key, kind in (("sft", bool), ("ppo", bool), ("model", str), ("data_policy", str), ("sft_data", str),
                      ("label", str)):
        if key in entry:
            if not isinstance(entry[key], kind):
                raise UserError(f"{where}.{key} must be {'true or false' if kind is bool else 'text'}, "
                                f"got {entry[key]!r}")
            setattr(arm, key, entry[key])
    if arm.data_policy not in ("", "model", "random"):
        raise UserError(f"{where}.data_policy must be one of model, random; got {arm.data_policy!r}")
    for key in ("train_env", "data_env"):
        if key in entry:
            game = {"name": entry[key]} if isinstance(entry[key], str) else entry[key]
            setattr(arm, key, asdict(from_dict(game, EnvConfig, f"{where}.{key}.")))
    sets = entry.get("set", {})
    if not isinstance(sets, dict):
        raise UserError(f"{where}.set must be a mapping of dotted settings, e.g. {{sft.epochs: 1}}")
    for key in sets:
        section, _, rest = str(key).partition(".")
        if section not in ARM_SECTIONS or not rest:
            raise UserError(f"{where}.set: {key!r} is not a setting of the arm's stages; give "
                            f"section.key with a section among {', '.join(ARM_SECTIONS)}")
        if rest in PIPELINE_KEYS:
            raise UserError(f"{where}.set: the pipeline sets {key} itself; leave it out")
    arm.set = {**arm.set, **sets}
    if (arm.sft_data or arm.data_env or arm.data_policy) and not arm.sft:
        raise UserError(f"{where}: data_policy, data_env and sft_data describe SFT data, and arm {name!r} has "
                        "no SFT; set sft: true or leave them out")
    if arm.sft_data and (arm.data_env or arm.data_policy):
        raise UserError(f"{where}: sft_data replaces the played data, so data_env and data_policy do not apply")
    return arm


# ---- stages --------------------------------------------------------------------------------------


@dataclass
class Stage:
    """One stage of the run: its kind, its id (which names its output) and its config."""

    kind: str
    id: str
    config: SPAConfig
    upstream: Stage | None
    key: str  # what the stage computes: its settings and its upstream stages' (paths left out)
    arms: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.id}"

    def output(self) -> str:
        """The path the next stage reads: the trajectories, the SFT rows, or a model."""
        cfg = self.config
        paths = {"generate": cfg.generate.out, "clean": cfg.clean.out, "sft": str(Path(cfg.sft.out) / "final"),
                 "ppo": str(Path(cfg.ppo.out) / "final"), "eval": cfg.eval.out, "probe": cfg.eval.out}
        return paths[self.kind]


def resolve(config: SPAConfig, arm: Arm) -> list[Stage]:
    """The arm's chain of stages, with the paths that depend on stage ids left as `CHAINED`."""
    try:
        arm_config = with_overrides(config, arm.set)
    except UserError as err:
        raise UserError(f"arm {arm.name}: {err}") from None
    for section in (arm_config.generate, arm_config.sft, arm_config.ppo, arm_config.eval):
        section.resume = False  # the pipeline decides what is resumed (`run`)
    if arm.ppo:  # evaluated as it was trained, unless the arm says otherwise
        for mode in ("prompt_mode", "render_mode"):
            if f"eval.{mode}" not in arm.set:
                setattr(arm_config.eval, mode, getattr(arm_config.ppo, mode))
    start = arm.model or config.model.name
    trained_on = copy.deepcopy(arm_config)  # the game of the arm's SFT data and PPO
    if arm.train_env:
        trained_on.env = EnvConfig(**copy.deepcopy(arm.train_env))
    chain: list[Stage] = []

    def add(kind: str, stage_config: SPAConfig) -> str:
        upstream = chain[-1] if chain else None
        chain.append(Stage(kind, "", stage_config, upstream, _key(kind, stage_config, upstream)))
        return CHAINED

    model = start
    if arm.sft:
        data = arm.sft_data
        if not data:
            played = copy.deepcopy(trained_on)
            played.model.name = start
            if arm.data_env:
                played.env = EnvConfig(**copy.deepcopy(arm.data_env))
            played.rollout.groups = config.pipeline.data_groups
            played.rollout.group_size = config.pipeline.data_group_size or played.rollout.group_size
            if (arm.data_policy or config.pipeline.data_policy) == "random":
                played.rollout.backend = "random"
            played.generate.out = add("generate", played)
            cleaned = copy.deepcopy(arm_config)
            cleaned.env = copy.deepcopy(played.env)  # the game the data was played on
            cleaned.clean.data = cleaned.clean.out = CHAINED
            data = add("clean", cleaned)
        tuned = copy.deepcopy(arm_config)
        tuned.model.name, tuned.sft.data, tuned.sft.val_data, tuned.sft.out = start, data, "", CHAINED
        model = add("sft", tuned)
    if arm.ppo:
        trained = copy.deepcopy(trained_on)
        trained.model.name, trained.ppo.out = model, CHAINED
        model = add("ppo", trained)
    trained_model = chain[-1] if chain else None
    evaluated = copy.deepcopy(arm_config)
    evaluated.model.name, evaluated.eval.out = model, CHAINED
    add("eval", evaluated)
    if config.eval.probe_states:  # of the arm's final model, asked what every arm's model is asked
        probed = copy.deepcopy(config)
        probed.model.name, probed.eval.out = model, CHAINED
        chain.append(Stage("probe", "", probed, trained_model, _key("probe", probed, trained_model)))
    return chain


def _sections(kind: str, config: SPAConfig) -> dict[str, Any]:
    """The settings a stage of `kind` reads (`SECTIONS`, `PROBE_KEYS`)."""
    data = asdict(config)
    sections = {section: data[section] for section in SECTIONS[kind]}
    if kind == "probe":
        sections["probe"] = {f"{section}.{key}": data[section][key] for section, keys in PROBE_KEYS.items()
                             for key in keys}
    if kind == "eval":
        del sections["eval"]["probe_states"]
    return sections


def _key(kind: str, config: SPAConfig, upstream: Stage | None) -> str:
    sections = _sections(kind, config)
    if kind == "generate" and config.rollout.backend == "random":
        del sections["model"]  # random actions: the model does not play
    return json.dumps({"kind": kind, "sections": sections, "upstream": upstream.key if upstream else None},
                      sort_keys=True)


@dataclass
class Plan:
    """Every stage of the run in the order they run, the eval stage of each arm (the rows) and, with
    `eval.probe_states`, the probe of each arm's final model (arms that end in one model share it)."""

    config: SPAConfig
    dir: Path
    arms: list[Arm]
    stages: list[Stage]
    rows: dict[str, Stage]
    probes: dict[str, Stage] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        status = statuses(self)
        planned = {stage.name: plan for stage, plan in memory_plans(self)}
        return {
            "dir": str(self.dir), "env": self.config.env.name, "model": self.config.model.name,
            "arms": [{"name": arm.name, "label": arm.label, "stages": _arm_stages(self.rows[arm.name]),
                      "report": self.rows[arm.name].config.eval.out,
                      "probe": self.probes[arm.name].config.eval.out if arm.name in self.probes else None}
                     for arm in self.arms],
            "stages": [{"name": stage.name, **describe_stage(stage), "status": status[stage.name],
                        **({"memory": planned[stage.name].to_json()} if stage.name in planned else {})}
                       for stage in self.stages],
        }


#: (game, model family, the game the paper plays with that family): where the paper's board for a
#: model is not the game's default ("6 x 6 for Qwen2.5-3B to avoid a ceiling effect", §3).
PAPER_BOARDS = (("frozen_lake", "qwen2.5-3b", "frozen_lake_6x6"),)


def check_paper_board(env: EnvConfig, model: str) -> None:
    """Refuse the default board of a game with a model the paper plays it on another board with."""
    for game, family, paper_game in PAPER_BOARDS:
        if env.name == game and family in model.lower() and "size" not in env.options:
            raise UserError(f"env {game} plays its default board, and the paper plays {model} on {paper_game} (its §3); "
                            f"--set env.name={paper_game} plays the paper's board, --set env.options.size=N the board you choose")


def plan(config: SPAConfig) -> Plan:
    """The run `config` asks for, every arm and stage checked; nothing is run or written."""
    chosen = arms(config)
    check_model_name(config.model.name)
    for model in {config.model.name, *(arm.model for arm in chosen if arm.model)}:
        check_paper_board(config.env, model)
    ordered = [a for name in BUILT_IN for a in chosen if a.name == name] + [a for a in chosen if a.name not in BUILT_IN]
    by_key: dict[str, Stage] = {}
    by_id: dict[tuple[str, str], Stage] = {}
    stages: list[Stage] = []
    rows: dict[str, Stage] = {}
    probes: dict[str, Stage] = {}
    for arm in ordered:
        if arm.model:
            _in_arm(arm, check_model_name, arm.model)
        chain = resolve(config, arm)
        reference = {s.kind: s.key for s in resolve(config, BUILT_IN[arm.like])} if arm.like else {}
        for spec in chain:
            spec.upstream = by_key[spec.upstream.key] if spec.upstream else None
            if spec.key in by_key:
                by_key[spec.key].arms.append(arm.name)
                continue
            source = BUILT_IN.get(arm.name) or (BUILT_IN[arm.like] if reference.get(spec.kind) == spec.key else arm)
            spec.id = source.ids.get(spec.kind, source.name)
            if (spec.kind, spec.id) in by_id:
                raise UserError(f"arm {arm.name}: its {spec.kind} stage differs from, but would be named like, "
                                f"{spec.kind}/{spec.id} of arm {by_id[spec.kind, spec.id].arms[0]}; rename the arm")
            spec.arms.append(arm.name)
            _place(spec, Path(config.pipeline.dir))
            by_key[spec.key] = by_id[spec.kind, spec.id] = spec
            stages.append(spec)
        for spec in chain:
            if spec.kind in ("eval", "probe"):
                (rows if spec.kind == "eval" else probes)[arm.name] = by_key[spec.key]
    for stage in stages:
        _in_arm(stage, check_stage, stage)
    _check_same_eval(config, chosen, rows)
    return Plan(config, Path(config.pipeline.dir), chosen, stages, rows, probes)


def _place(stage: Stage, root: Path) -> None:
    """Fill in the stage's paths: its output under `root`, its input the upstream stage's output."""
    cfg, upstream = stage.config, stage.upstream.output() if stage.upstream else None
    if stage.kind == "generate":
        cfg.generate.out = str(root / "data" / f"{stage.id}.jsonl")
    elif stage.kind == "clean":
        cfg.clean.data, cfg.clean.out = upstream, str(root / "sft_data" / f"{stage.id}.jsonl")
    elif stage.kind == "sft":
        cfg.sft.data = upstream if cfg.sft.data == CHAINED else cfg.sft.data
        cfg.sft.out = str(root / "sft" / stage.id)
    elif stage.kind == "ppo":
        cfg.model.name = upstream if cfg.model.name == CHAINED else cfg.model.name
        cfg.ppo.out = str(root / "ppo" / stage.id)
    else:
        cfg.model.name = upstream if cfg.model.name == CHAINED else cfg.model.name
        cfg.eval.out = str(root / stage.kind / f"{stage.id}.json")


def check_stage(stage: Stage) -> None:
    """What each stage would refuse, refused now, before anything runs."""
    cfg = stage.config
    if stage.kind == "generate":
        check_modes(cfg.env, cfg.generate.prompt_mode, cfg.generate.render_mode, "generate")
    elif stage.kind == "clean":
        from stages.clean import check_recipe

        check_recipe(cfg.clean)
    elif stage.kind == "sft" and stage.upstream is None:
        data = cfg.sft.data
        if not spa_data.is_hub_dataset(data) and not Path(data).is_file():
            raise UserError(f"sft_data {data} does not exist; give an SFT file (spa clean's JSONL, SPA's "
                            "wm_train.parquet) or a hub dataset id")
    elif stage.kind == "ppo":
        from stages import ppo

        ppo.check_config(cfg)
    elif stage.kind == "eval":
        from stages.evaluation.runner import sample_plan

        sample_plan(cfg.eval)
        check_modes(cfg.env, cfg.eval.prompt_mode, cfg.eval.render_mode, "eval")
    elif stage.kind == "probe":
        from stages import probe

        probe.check(cfg, cfg.eval.probe_states)


def _in_arm(where: Arm | Stage, check: Callable[[Any], None], value: Any) -> None:
    """Run a check; its error names the arm(s) it concerns."""
    try:
        check(value)
    except UserError as err:
        names = where.arms if isinstance(where, Stage) else [where.name]
        raise UserError(f"arm {', '.join(names)}: {err}") from None


def _check_same_eval(config: SPAConfig, chosen: list[Arm], rows: dict[str, Stage]) -> None:
    reference = {k: v for k, v in asdict(config.eval).items() if k not in ARM_EVAL_KEYS}
    for arm in chosen:
        mine = {k: v for k, v in asdict(rows[arm.name].config.eval).items() if k not in ARM_EVAL_KEYS}
        changed = next((k for k in reference if reference[k] != mine[k]), None)
        if changed is not None:
            raise UserError(f"arm {arm.name} sets eval.{changed}; every arm is evaluated with the same settings "
                            f"(only eval.prompt_mode and eval.render_mode are an arm's own); set it for the "
                            "whole pipeline instead")


def _arm_stages(stage: Stage) -> list[str]:
    names = []
    while stage is not None:
        names.insert(0, stage.name)
        stage = stage.upstream
    return names


# ---- the plan in words -----------------------------------------------------------------------------


def describe_stage(stage: Stage) -> dict[str, Any]:
    """What the stage does, for the dry run: model, prompt and render mode, size, input, output."""
    cfg, rollout = stage.config, stage.config.rollout
    info: dict[str, Any] = {"kind": stage.kind, "arms": list(stage.arms)}
    if stage.kind == "generate":
        policy = "random actions (RandSFT)" if rollout.backend == "random" else cfg.model.name
        info |= {"env": cfg.env.name, "model": policy, "prompt_mode": cfg.generate.prompt_mode,
                 "render_mode": cfg.generate.render_mode,
                 "size": f"{rollout.groups} puzzles x {rollout.group_size} = {rollout.groups * rollout.group_size} "
                         "episodes", "output": cfg.generate.out}
    elif stage.kind == "clean":
        c = cfg.clean
        info |= {"data": c.data, "size": f"{c.unit} rows, states {c.states}, format filter "
                 f"{'on' if c.filter_format else 'off'}" + (", random coordinates" if c.random_coordinates else ""),
                 "output": c.out}
    elif stage.kind == "sft":
        s = cfg.sft
        info |= {"model": cfg.model.name, "data": s.data,
                 "size": f"{s.epochs} epochs, {s.global_batch} rows a step, lr {s.lr:g}, state text {s.state_text}",
                 "output": str(Path(s.out) / "final")}
    elif stage.kind == "ppo":
        p = cfg.ppo
        reward = "" if p.state_reward == "none" else (f", state reward {p.state_reward} "
                                                      f"({p.observation_weight:g}/{p.prediction_weight:g})")
        info |= {"env": cfg.env.name, "model": cfg.model.name, "prompt_mode": p.prompt_mode,
                 "render_mode": p.render_mode,
                 "size": f"{p.steps} steps of {rollout.groups} x {rollout.group_size} episodes{reward}",
                 "output": str(Path(p.out) / "final")}
    elif stage.kind == "probe":
        info |= {"env": cfg.env.name, "model": cfg.model.name, "prompt_mode": "world_model",
                 "render_mode": cfg.eval.render_mode,
                 "size": f"{cfg.eval.probe_states} states, every action of each", "output": cfg.eval.out}
    else:
        e = cfg.eval
        n = e.pass_k if e.n is None else e.n
        info |= {"env": cfg.env.name, "model": cfg.model.name, "prompt_mode": e.prompt_mode,
                 "render_mode": e.render_mode, "size": f"{e.seeds} puzzles x {n} samples, Pass@{e.pass_k}",
                 "output": e.out}
    return info


def describe(the_plan: Plan) -> str:
    """The plan as text: the arms (table rows), then each stage with its status."""
    status = statuses(the_plan)
    by_name = {stage.name: plan for stage, plan in memory_plans(the_plan)}
    config = the_plan.config
    # without a GPU here the plans are sized for DEFAULT_GPU_GIB: say so, the run itself is on the CPU
    gpu_note = "" if memory.gpu_capacity() else " (planned for one 80 GB GPU; none here)"
    title = (f"spa pipeline: {the_plan.dir} ({config.env.name}, {config.model.name}): {len(the_plan.arms)} arms, "
             f"{len(the_plan.stages)} stages")
    lines = [title, "", "arms (rows of table.md):"]
    for arm in the_plan.arms:
        probed = f", {the_plan.probes[arm.name].name}" if arm.name in the_plan.probes else ""
        lines.append(f"  {arm.name:<26} {arm.label:<40} {' -> '.join(_arm_stages(the_plan.rows[arm.name]))}{probed}")
    lines += ["", "stages, in the order they run:"]
    for stage in the_plan.stages:
        info = describe_stage(stage)
        lines.append(f"  {stage.name}  [{status[stage.name]}]  arms: {', '.join(stage.arms)}")
        for label, key in (("model", "model"), ("data", "data"), ("env", "env")):
            if key in info:
                lines.append(f"      {label:<8} {info[key]}")
        if "prompt_mode" in info:
            lines.append(f"      {'prompt':<8} {info['prompt_mode']}, states {info['render_mode']}")
        lines += [f"      {'size':<8} {info['size']}", f"      {'output':<8} {info['output']}"]
        if stage.name in by_name:
            lines.append(f"      {'memory':<8} {memory.verdict(by_name[stage.name])}{gpu_note}")
    return "\n".join(lines)


# ---- memory ----------------------------------------------------------------------------------------


def starting_model(stage: Stage) -> str:
    """The model the stage's arm starts from (a later stage trains or evaluates its outputs, which
    have its shape and do not exist yet)."""
    while stage.upstream is not None:
        stage = stage.upstream
    return stage.config.model.name


def memory_plans(the_plan: Plan, gpus: int = 1, capacity: int | None = None,
                 download: bool = False) -> list[tuple[Stage, memory.StagePlan]]:
    """The memory plan (`stages.training.memory`) of every stage that uses a GPU, on `gpus` GPUs of
    `capacity` bytes (default: the GPU here, else an 80 GB one), each sized from its arm's starting
    model without the network unless `download`."""
    capacity = capacity or memory.capacity()
    planned = []
    for stage in the_plan.stages:
        if stage.kind in ("clean", "probe"):  # no GPU; a probe holds less than its arm's eval
            continue
        shape = model_shape(starting_model(stage), stage.config.model.trust_remote_code, download)
        plan = memory.plan_stage(stage.kind, stage.config, shape, gpus, capacity, stage.name)
        if plan.need:  # a random-policy generate loads no model
            planned.append((stage, plan))
    return planned


def memory_error(planned: list[tuple[Stage, memory.StagePlan]]) -> str:
    """The one-line refusal of the first stage that does not fit ("" when every one fits), naming what
    would make it fit; `spa pipeline` runs in one process, so more GPUs are not among the fixes."""
    too_big = [(stage, plan) for stage, plan in planned if not plan.fits]
    if not too_big:
        return ""
    stage, plan = too_big[0]
    shape = model_shape(starting_model(stage), stage.config.model.trust_remote_code)
    others = f" (and {len(too_big) - 1} more stage{'s' if len(too_big) > 2 else ''})" if len(too_big) > 1 else ""
    return memory.too_big(plan, stage.config, shape, other_gpus=False, who=stage.name + others)


# ---- running ---------------------------------------------------------------------------------------


def stage_inputs(stage: Stage) -> list[Path]:
    """The files a stage reads; their hashes are part of its fingerprint."""
    cfg = stage.config
    if stage.kind == "clean":
        return [Path(cfg.clean.data)]
    if stage.kind == "sft":
        if spa_data.is_hub_dataset(cfg.sft.data):
            return []
        data, spa_val = spa_data.locate(cfg.sft.data)
        return [data, spa_val or artifacts.val_path(data)]
    if stage.kind in ("ppo", "eval", "probe"):
        model = Path(cfg.model.name)
        return sorted(model.glob("*.safetensors")) if model.is_dir() else []
    return []


def fingerprint(stage: Stage) -> str:
    sections = _sections(stage.kind, stage.config)
    if stage.config.rollout.backend != "random" and "rollout" in sections:
        for key in RANDOM_BACKEND_KEYS:
            del sections["rollout"][key]
    content = {
        "config": sections,
        "inputs": {str(p): artifacts.file_sha256(p) for p in stage_inputs(stage) if p.is_file()},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def statuses(the_plan: Plan) -> dict[str, str]:
    """Per stage: "complete" (will be skipped), "resume" or "run". A stage after one that will
    run runs too (its inputs will change), so its status is "run" whatever was recorded."""
    path = the_plan.dir / STATE_FILE
    state = artifacts.read_json(path) if path.is_file() else {}
    found: dict[str, str] = {}
    for stage in the_plan.stages:
        recorded = state.get(stage.name, {})
        upstream_done = stage.upstream is None or found[stage.upstream.name] == "complete"
        same = upstream_done and recorded.get("fingerprint") == fingerprint(stage)
        found[stage.name] = ("complete" if recorded.get("complete") else "resume") if same else "run"
    return found


def stage_outputs(stage: Stage) -> list[Path]:
    cfg = stage.config
    if stage.kind == "generate":
        out = Path(cfg.generate.out)
        return [out, artifacts.manifest_path(out)]
    if stage.kind == "clean":
        out = Path(cfg.clean.out)
        return [out, artifacts.val_path(out), artifacts.manifest_path(out)]
    if stage.kind == "sft":
        return [Path(cfg.sft.out)]
    if stage.kind == "ppo":
        return [Path(cfg.ppo.out)]
    out = Path(cfg.eval.out)  # an eval's or a probe's report, and its sidecars
    return [out, *out.parent.glob(f"{out.stem}.*")]


def run(config: SPAConfig) -> dict[str, Any]:
    """Run (or continue) every stage of every arm; return the comparison and what was skipped."""
    from stages.agent.backends import check_backend

    distributed.require_one_process("pipeline", "run it in one process, or run its stages one by one, generate, "
                                    "sft, ppo and eval under the launcher (docs/gpu.md)")
    console = Console(config.quiet)
    check_backend(config.model, config.rollout)  # a missing vLLM fails now, not after the SFT
    tracking.check(config.tracking)  # before the first stage, not when sft starts
    the_plan = plan(config)
    on_cuda = pick_device(config.model.device).startswith("cuda")
    if any(getattr(stage.config, stage.kind).engine_stage(on_cuda, 1) > 0 for stage in the_plan.stages
           if stage.kind in ("sft", "ppo")):
        engine.require_deepspeed()  # a ZeRO stage without DeepSpeed fails now, not after the first eval
    if on_cuda:  # every stage fits this GPU, or nothing runs
        error = memory_error(memory_plans(the_plan, download=True))
        if error:
            raise UserError(f"{error} (spa plan CONFIG shows every stage)")
    artifacts.check_writable(the_plan.dir)
    the_plan.dir.mkdir(parents=True, exist_ok=True)
    state_path = the_plan.dir / STATE_FILE
    state = artifacts.read_json(state_path) if state_path.is_file() else {}
    skipped = []
    for stage in the_plan.stages:
        key = fingerprint(stage)
        recorded = state.get(stage.name, {})
        if recorded.get("fingerprint") == key and recorded.get("complete"):
            console.result(f"[pipeline] {stage.name}: complete, skipped")
            skipped.append(stage.name)
            continue
        resume = recorded.get("fingerprint") == key  # started with the same settings: continue it
        if not resume:
            _remove(stage_outputs(stage))
        console.result(f"[pipeline] {stage.name} ({', '.join(stage.arms)}): {'resuming' if resume else 'running'}")
        state[stage.name] = {"fingerprint": key, "complete": False}
        artifacts.write_json(state_path, state)
        start = time.perf_counter()
        rss.reset_peak()
        _runner(stage.kind)(copy.deepcopy(stage.config), resume, console)
        peak = rss.peak()
        _release_memory()
        # the wall time and peak memory of the call that completed it (a resumed stage's earlier
        # calls are not in them)
        seconds = round(time.perf_counter() - start, 1)
        state[stage.name] |= {"complete": True, "seconds": seconds, "resumed": resume, **peak}
        artifacts.write_json(state_path, state)
        console.result(f"[pipeline] {stage.name}: done in {duration(seconds)}{' (resumed)' if resume else ''}, "
                       f"{_peak_text(peak)}")
    stages = {stage.name: state[stage.name] for stage in the_plan.stages}
    console.result(summary(stages))
    table = write_table(the_plan)
    console.result(table)
    write_plots(the_plan)
    return {"dir": str(the_plan.dir), "skipped": skipped, "stages": stages, "table": table}


def summary(stages: dict[str, dict[str, Any]]) -> str:
    """Each stage's wall time and peak RSS as recorded in pipeline_state.json, one line each."""
    width = max(map(len, stages), default=0)
    lines = ["[pipeline] stages (wall time, peak RSS):"]
    for name, record in stages.items():
        took = duration(record["seconds"]) if "seconds" in record else "-"
        peak = _peak_text(record) if "peak_rss_gb" in record else "peak RSS not recorded"
        lines.append(f"  {name:<{width}}  {took:>8}  {peak}")
    return "\n".join(lines)


def _peak_text(peak: dict[str, Any]) -> str:
    since = "" if peak["peak_rss_since"] == "stage" else " (the process's peak so far)"
    return f"peak RSS {peak['peak_rss_gb']:.1f} GB{since}"


def _runner(kind: str) -> Callable[[SPAConfig, bool, Console], Any]:
    """The stage's run, continuing its earlier output when `resume` (every stage can)."""
    from stages import clean, evaluate, generate, ppo, probe, sft
    from stages.evaluation.tables import print_report

    def run_eval(cfg: SPAConfig, resume: bool, console: Console) -> Any:
        cfg.eval.resume = resume
        report = evaluate.run(cfg)
        if not cfg.quiet:
            print_report(report)
        return report

    def resumed(stage: Any, section: str) -> Callable[[SPAConfig, bool, Console], Any]:
        def run_stage(cfg: SPAConfig, resume: bool, console: Console) -> Any:
            getattr(cfg, section).resume = resume
            return stage.run(cfg)
        return run_stage

    def run_probe(cfg: SPAConfig, resume: bool, console: Console) -> Any:
        return probe.run(cfg, cfg.eval.out, states=cfg.eval.probe_states)  # minutes: an interrupted one reruns

    runners = {"generate": resumed(generate, "generate"), "clean": lambda cfg, _, __: clean.run(cfg),
               "sft": resumed(sft, "sft"), "ppo": resumed(ppo, "ppo"), "eval": run_eval, "probe": run_probe}
    return runners[kind]


def _release_memory() -> None:
    """Free what the finished stage held (its models) before the next stage loads its own: the
    stages run in this one process. A stage shuts down the vLLM engine it opened itself (`close`:
    an in-process engine freezes the garbage collector's view of its objects until then), and the
    training engines it trained with (`close`). glibc keeps the freed heap otherwise, and the next
    stage would start beside the last one's resident pages (docs/results.md)."""
    import gc

    from stages.common.rss import return_freed_memory

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return_freed_memory()


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ---- the table -------------------------------------------------------------------------------------


#: The probe's headline (`probe.headline`) as columns of table.md.
PROBE_COLUMNS = {"changed_exact": "probe exact, state changed", "changed_cells": "probe cells, state changed",
                 "true_more_likely": "probe true > copy"}


def write_table(the_plan: Plan) -> str:
    """table.md: one row per arm, like the paper's Table 2 (percent, x10^-2) for this game, with the
    world-model accuracy, the state perplexity when measured (`eval.state_ppl`: raw grid / with
    coordinates, the paper's Table 1), the headline of the probe of the arm's final model when
    probed (`eval.probe_states`: exact and cell accuracy where the action changes the state, and how
    often the true next state is more likely than the copy) and each arm's Pass@1 and Pass@k (unless
    k is 1) minus the first arm's, with the 95% interval of `spa eval compare` (the same puzzles resampled for both);
    under it, the PPO steps each RL arm had."""
    from stages import probe
    from stages.evaluation.reports import compare_rows
    from stages.evaluation.tables import difference, forms

    names = [arm.name for arm in the_plan.arms if Path(the_plan.rows[arm.name].config.eval.out).is_file()]
    rows = compare_rows([the_plan.rows[name].config.eval.out for name in names]) if names else []
    k = rows[0]["k"] if rows else the_plan.config.eval.pass_k
    labels = {arm.name: arm.label or arm.name for arm in the_plan.arms}
    with_ppl = any(row["state_ppl_coords"] is not None for row in rows)
    first = labels[names[0]] if names else "the first arm"
    with_k = k != 1  # Pass@1 is its own column
    header = [the_plan.config.env.name, "Pass@1", *([f"Pass@{k}"] if with_k else []), "observation exact",
              "prediction exact", "prediction exact, state changed", "state changed: grid / coordinates exact",
              "prediction cells", *(["state PPL raw / coords"] if with_ppl else []),
              *(PROBE_COLUMNS.values() if the_plan.probes else []), f"Pass@1 vs {first} [95%]",
              *([f"Pass@{k} vs {first} [95%]"] if with_k else [])]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, row in zip(names, rows):
        keys = ("pass@1", *(["pass@k"] if with_k else []), "observation_exact", "prediction_exact",
                "prediction_of_change_exact")
        figures = [*(_percent(row[key]) for key in keys), forms(row), _percent(row["prediction_cells"])]
        if with_ppl:
            figures.append(f"{_number(row['state_ppl_raw'])} / {_number(row['state_ppl_coords'])}")
        if the_plan.probes:
            report = Path(the_plan.probes[name].config.eval.out)
            headline = probe.headline(probe.load_report(report)) if report.is_file() else {}
            figures += [_percent(headline.get(key)) for key in PROBE_COLUMNS]
        figures += [difference(row["pass@1_vs_first"]), *([difference(row["pass@k_vs_first"])] if with_k else [])]
        lines.append(f"| {labels[name]} | " + " | ".join(figures) + " |")
    table = "\n".join(lines) + "\n"
    if trained := _ppo_budgets(the_plan, names, labels):
        table += f"\nPPO: {'; '.join(trained)}.\n"
    with artifacts.atomic_write(the_plan.dir / "table.md") as handle:
        handle.write(table)
    return table


def _ppo_budgets(the_plan: Plan, names: list[str], labels: dict[str, str]) -> list[str]:
    """How much RL each arm of the table had (a one-step run is a smoke test, not RL's effect)."""
    budgets = []
    for name in names:
        ppo = the_plan.rows[name].upstream
        if ppo is not None and ppo.kind == "ppo":
            rollout, steps = ppo.config.rollout, ppo.config.ppo.steps
            budgets.append(f"{labels[name]} after {steps} step{'s' if steps > 1 else ''} of "
                           f"{rollout.groups} x {rollout.group_size} episodes")
    return budgets


def write_plots(the_plan: Plan) -> None:
    """curves.png from the training runs' metrics (sft/ID, ppo/ID), pass_at_k.png from the arms'
    eval reports, ppo/ID/val/pass_at_k.png from each PPO run's validations (the paper's Fig. 7), and
    validation.png, the validation Pass@1 of every PPO run validated more than once against its
    step, with 95% bands."""
    from stages.evaluation import plots
    from stages.evaluation.reports import load_report

    with contextlib.suppress(UserError):  # no training stage in this run: no curves
        plots.plot_curves(plots.runs_in(the_plan.dir), the_plan.dir / "curves.png")
    arms = [arm for arm in the_plan.arms if Path(the_plan.rows[arm.name].config.eval.out).is_file()]
    if arms:
        plots.plot_pass_at_k([load_report(the_plan.rows[arm.name].config.eval.out) for arm in arms],
                             the_plan.dir / "pass_at_k.png", [arm.label or arm.name for arm in arms])
    ppo_runs = sorted(the_plan.dir.glob("ppo/*"))
    validated = dict(plots.read_validations(ppo_runs, [run.name for run in ppo_runs]))
    for run in ppo_runs:
        if steps := validated.get(run.name):
            plots.plot_pass_at_k([report for _, report in steps], run / "val" / "pass_at_k.png",
                                 [f"step {step}" for step, _ in steps])
    if curves := [(name, steps) for name, steps in validated.items() if len(steps) > 1]:
        plots.save_png(plots.validation_figure(curves), the_plan.dir / "validation.png")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"

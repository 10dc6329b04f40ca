"""Bad input through the real `spa` command line, as tables covering every subcommand.

Each case must end the way a user error ends: exit code 2, one line on stderr that starts with
`error:` and names the problem, no traceback, and nothing written: the files under the workspace
(inputs and outputs) are byte for byte what they were before. Faults of the machine are real:

* unreadable files and read-only directories come from file modes; as root, the command runs in a
  subprocess without the two capabilities that let root ignore modes;
* a full disk is a tiny tmpfs mounted in a user + mount namespace (skipped where the kernel allows
  no such namespace); there a run may keep what it finished, but only whole files: every JSON and
  JSONL file parses, no temp file is left, and the same command continues once there is space;
* a full disk is also injected in-process (fsync failing with ENOSPC, as delayed allocation
  reports it), which runs everywhere.

The number of cases tried is printed at the end of the session (tests/conftest.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spa_cli.main import app

runner = CliRunner()

# ---- the commands, each valid apart from the one bad piece a case adds ----------------------------

GENERATE = ("generate", "--backend", "random", "--groups", "1", "--group-size", "1", "--out", "{out}/t.jsonl")
CLEAN = ("clean", "--data", "{traj}", "--out", "{out}/s.jsonl")
SFT = ("sft", "--data", "{sft}", "--model", "{model}", "--out", "{out}/run", "--set", "sft.zero_stage=0")
PPO = ("ppo", "--model", "{model}", "--out", "{out}/run", "--set", "rollout.groups=2", "--set",
       "rollout.group_size=2", "--set", "ppo.filter_ratio=1.0", "--set", "ppo.mini_batch=2")
EVAL = ("eval", "--backend", "random", "--seeds", "1", "--pass-k", "1", "--out", "{out}/r.json")
PIPELINE = ("pipeline", "--dir", "{out}/run")
CONFIG_SHOW = ("config", "show")
#: A game with no world-model prompt and no coordinates (tests/helpers.py).
NO_STATES = "helpers:NoStatesGame"
WITH_CONFIG = {"generate": GENERATE, "clean": CLEAN, "sft": SFT, "ppo": PPO, "eval": EVAL, "pipeline": PIPELINE,
               "config-show": CONFIG_SHOW}


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    says: str  # a piece of the error line
    existing: dict[str, str] = field(default_factory=dict)  # files under {out} before the run


def generate_settings(*sets: str) -> dict:
    """What `spa generate` records for GENERATE's settings changed by `sets` (a run's manifest)."""
    from stages import generate
    from stages.common.config import load_config

    return generate.settings(load_config(None, ["rollout.backend=random", *sets]))


def case(name: str, command: tuple[str, ...], *extra: str, says: str, existing: dict | None = None) -> Case:
    return Case(name, (*command, *extra), says, existing or {})


CONFIG_CASES = [
    case(f"{name}-{problem}", command, *extra, says=says)
    for name, command in WITH_CONFIG.items()
    for problem, extra, says in [
        ("config-missing", ("--config", "{ws}/missing.yaml"), "does not exist"),
        ("config-not-yaml", ("--config", "{ws}/bad.yaml"), "is not valid YAML at line 2"),
        ("config-not-mapping", ("--config", "{ws}/list.yaml"), "must be a mapping of sections"),
        ("config-inherit-loop", ("--config", "{ws}/loop.yaml"), "inherits from itself"),
        ("config-inherit-missing", ("--config", "{ws}/orphan.yaml"), "does not exist"),
        ("config-python-tag", ("--config", "{ws}/code.yaml"), "is not valid YAML"),
        ("config-is-dir", ("--config", "{ws}"), "cannot read config file"),
        ("set-no-equals", ("--set", "rollout.max_turns"), "--set expects key.path=value"),
        ("set-unknown-key", ("--set", "rollout.max_trns=3"), "unknown config key 'rollout.max_trns'"),
        ("set-wrong-type", ("--set", "rollout.max_turns=many"), "rollout.max_turns must be an integer"),
        ("set-section-to-a-value", ("--set", "env=3"), "env must be a mapping"),
        ("set-below-a-value", ("--set", "rollout.max_turns=1", "--set", "rollout.max_turns.x=2"),
         "'max_turns' is not a section"),
    ]
]

PLOT_PROBLEM = "is a file"

STAGE_CASES = [
    # generate
    case("generate-unknown-env", GENERATE, "--env", "nope", says="unknown env 'nope'"),
    case("generate-unknown-env-option", GENERATE, "--set", "env.options={foo: 1}", says="has no option 'foo'"),
    case("generate-zero-groups", GENERATE, "--groups", "0", says="rollout.groups must be >= 1"),
    case("generate-negative-group-size", GENERATE, "--group-size", "-1", says="rollout.group_size must be >= 1"),
    case("generate-negative-seed", GENERATE, "--seed", "-1", says="rollout.seed must be >= 0"),
    case("generate-groups-not-a-number", GENERATE, "--groups", "abc", says="Invalid value for '--groups'"),
    case("generate-zero-turns", GENERATE, "--set", "rollout.max_turns=0", says="rollout.max_turns must be >= 1"),
    case("generate-top-p-zero", GENERATE, "--set", "rollout.top_p=0", says="rollout.top_p must be > 0 and <= 1"),
    case("generate-unknown-backend", GENERATE, "--backend", "nope", says="rollout.backend must be one of"),
    case("generate-model-missing", GENERATE, "--backend", "hf", "--model", "{ws}/nothing", says="is not a built-in"),
    case("generate-model-pickled", GENERATE, "--backend", "hf", "--model", "{ws}/pickled-model",
         says="only pickled weights (pytorch_model.bin)"),
    case("generate-model-without-config", GENERATE, "--backend", "hf", "--model", "{ws}/no-config-model",
         says="has no config.json"),
    case("generate-model-is-a-file", GENERATE, "--backend", "hf", "--model", "{file}", says="is not a built-in"),
    case("generate-out-under-a-file", GENERATE, "--out", "{file}/t.jsonl", says="is a file; choose another path"),
    case("generate-out-is-a-dir", GENERATE, "--out", "{ws}", says="is a directory"),
    case("generate-render-mode-the-game-lacks", GENERATE, "--env", "countdown",
         says="countdown has no 'coords' render mode (generate.render_mode); its render modes: text; set "
              "generate.render_mode=text"),
    case("generate-prompt-mode-the-game-lacks", GENERATE, "--env", NO_STATES, "--render-mode", "text",
         says=f"{NO_STATES} has no 'world_model' prompt mode (generate.prompt_mode); its prompt modes: base"),
    case("generate-unknown-render-mode", GENERATE, "--render-mode", "grid", says="generate.render_mode must be one of"),
    case("generate-out-holds-a-run", GENERATE, says="already holds a generate run; add --resume to continue it, "
         "or choose another --out", existing={"t.jsonl": '{"id": "sokoban-10000-0"}\n'}),
    case("generate-out-without-manifest", GENERATE, "--resume", says="has no readable t.jsonl.manifest.json",
         existing={"t.jsonl": '{"id": "sokoban-10000-0"}\n'}),
    case("generate-out-with-a-corrupt-manifest", GENERATE, "--resume", says="has no readable t.jsonl.manifest.json",
         existing={"t.jsonl": '{"id": "sokoban-10000-0"}\n', "t.jsonl.manifest.json": '{"settings": '}),
    case("generate-resume-other-settings", GENERATE, "--resume", "--seed", "5",
         says="it was made with other settings (rollout.max_turns: 2 -> 5)",
         existing={"t.jsonl": '{"id": "sokoban-10000-0"}\n',
                   "t.jsonl.manifest.json": json.dumps({"settings": generate_settings("rollout.max_turns=2")})}),
    # clean
    case("clean-data-missing", CLEAN, "--data", "{ws}/missing.jsonl", says="missing.jsonl does not exist"),
    case("clean-data-empty", CLEAN, "--data", "{ws}/empty.jsonl", says="holds no trajectories"),
    case("clean-data-torn-last-line", CLEAN, "--data", "{ws}/torn-traj.jsonl", says="torn-traj.jsonl:2: not valid JSON"),
    case("clean-data-not-json", CLEAN, "--data", "{ws}/not-json.jsonl", says="not-json.jsonl:1: not valid JSON"),
    case("clean-data-missing-keys", CLEAN, "--data", "{ws}/wrong-keys.jsonl", says="missing key(s) id, messages, turns"),
    case("clean-data-wrong-types", CLEAN, "--data", "{ws}/wrong-types.jsonl",
         says="is a trajectory (line 1: messages and turns must be lists)"),
    case("clean-data-not-objects", CLEAN, "--data", "{ws}/array.jsonl", says="not a JSON object"),
    case("clean-data-not-utf8", CLEAN, "--data", "{ws}/latin1.jsonl", says="is not UTF-8 text"),
    case("clean-data-is-a-dir", CLEAN, "--data", "{ws}", says="is not a file"),
    case("clean-out-under-a-file", CLEAN, "--out", "{file}/s.jsonl", says="is a file; choose another path"),
    case("clean-out-is-the-input", CLEAN, "--out", "{traj}", says="would overwrite the input"),
    case("clean-val-fraction-too-large", CLEAN, "--set", "clean.val_fraction=1.5", says="clean.val_fraction must be >= 0 and < 1"),
    case("clean-random-coordinates-of-beliefs", CLEAN, "--states", "self_belief", "--random-coordinates",
         says="needs clean.states=ground_truth"),
    case("clean-unknown-unit", CLEAN, "--unit", "row", says="clean.unit must be one of"),
    case("clean-parquet-without-prompt", CLEAN, "--data", "{ws}/no-prompt.parquet",
         says="no-prompt.parquet is not SPA's SFT data: it has no prompt column"),
    case("clean-spa-data-with-random-coordinates", CLEAN, "--data", "{ws}/wm_train.parquet",
         "--random-coordinates", says="clean.random_coordinates needs trajectories from `spa generate`"),
    # sft
    case("sft-data-missing", SFT, "--data", "{ws}/missing.jsonl", says="missing.jsonl does not exist"),
    case("sft-data-empty", SFT, "--data", "{ws}/empty.jsonl", says="has no rows"),
    case("sft-data-torn-last-line", SFT, "--data", "{ws}/torn-sft.jsonl", says="torn-sft.jsonl:2: not valid JSON"),
    case("sft-data-not-json", SFT, "--data", "{ws}/not-json.jsonl", says="not-json.jsonl:1: not valid JSON"),
    case("sft-data-missing-keys", SFT, "--data", "{ws}/wrong-keys.jsonl", says="missing key(s) messages"),
    case("sft-data-messages-not-a-list", SFT, "--data", "{ws}/wrong-types.jsonl", says="'messages' must be a non-empty"),
    case("sft-data-unknown-role", SFT, "--data", "{ws}/bad-role.jsonl", says="has role 'wizard'"),
    case("sft-data-no-assistant", SFT, "--data", "{ws}/no-assistant.jsonl", says="has no assistant message"),
    case("sft-data-parquet-without-response", SFT, "--data", "{ws}/wm_train.parquet",
         says="wm_train.parquet is not SPA's SFT data: it has no response column"),
    case("sft-data-not-parquet", SFT, "--data", "{ws}/bad.parquet", says="as parquet"),
    case("sft-data-hub-offline", SFT, "--data", "spa-test/no-such-dataset",
         says="cannot get the dataset 'spa-test/no-such-dataset' from the Hugging Face hub"),
    case("sft-unknown-state-text", SFT, "--state-text", "hidden", says="sft.state_text must be one of"),
    case("sft-zero-epochs", SFT, "--epochs", "0", says="sft.epochs must be >= 1"),
    case("sft-zero-global-batch", SFT, "--set", "sft.global_batch=0", says="sft.global_batch must be >= 1"),
    case("sft-zero-lr", SFT, "--set", "sft.lr=0", says="sft.lr must be > 0"),
    case("sft-lora-with-zero3", SFT, "--set", "sft.lora_rank=4", "--set", "sft.zero_stage=3", says="LoRA with ZeRO-3"),
    case("sft-model-missing", SFT, "--model", "{ws}/nothing", says="is not a built-in"),
    case("sft-model-pickled", SFT, "--model", "{ws}/pickled-model", says="only pickled weights"),
    case("sft-model-without-tokenizer", SFT, "--model", "{ws}/no-tokenizer-model", says="cannot load a tokenizer"),
    case("sft-out-is-a-file", SFT, "--out", "{file}", says="is a file; sft writes a directory"),
    case("sft-out-under-a-file", SFT, "--out", "{file}/run", says="is a file; choose another path"),
    case("sft-out-holds-a-run", SFT, says="already holds a sft run; add --resume", existing={"run/metrics.jsonl": ""}),
    case("sft-val-data-missing", SFT, "--set", "sft.val_data={ws}/missing.jsonl", says="validation data"),
    # ppo
    case("ppo-zero-steps", PPO, "--steps", "0", says="ppo.steps must be >= 1"),
    case("ppo-mini-batch-does-not-divide", PPO, "--set", "ppo.mini_batch=3", says="does not divide the episodes kept"),
    case("ppo-zero-filter-ratio", PPO, "--set", "ppo.filter_ratio=0", says="ppo.filter_ratio must be > 0 and <= 1"),
    case("ppo-zero-groups", PPO, "--set", "rollout.groups=0", says="rollout.groups must be >= 1"),
    case("ppo-grpo-single-sample", PPO, "--set", "ppo.advantage=grpo", "--set", "rollout.group_size=1",
         says="rollout.group_size must be >= 2"),
    case("ppo-random-backend", PPO, "--set", "rollout.backend=random", says="ppo needs a model backend"),
    case("ppo-history-window", PPO, "--set", "rollout.history_window=2", says="rollout.history_window=null"),
    case("ppo-negative-val-every", PPO, "--set", "ppo.val_every=-1", says="ppo.val_every must be >= 0"),
    case("ppo-float16", PPO, "--set", "model.dtype=float16", says="float32 or bfloat16"),
    case("ppo-unknown-env", PPO, "--env", "nope", says="unknown env 'nope'"),
    case("ppo-render-mode-the-game-lacks", PPO, "--env", "countdown",
         says="countdown has no 'coords' render mode (ppo.render_mode)"),
    case("ppo-state-reward-on-a-game-without-states", PPO, "--env", NO_STATES, "--render-mode", "text",
         "--set", "eval.render_mode=text", "--set", "ppo.state_reward=exact",
         says=f"rewards the <observation> and <prediction> of the world-model prompt, and {NO_STATES} has none"),
    case("ppo-validation-modes-the-game-lacks", PPO, "--env", "countdown", "--render-mode", "text",
         says="countdown has no 'coords' render mode (eval.render_mode)"),
    case("ppo-model-missing", PPO, "--model", "{ws}/nothing", says="is not a built-in"),
    case("ppo-model-pickled", PPO, "--model", "{ws}/pickled-model", says="only pickled weights"),
    case("ppo-out-is-a-file", PPO, "--out", "{file}", says="is a file; ppo writes a directory"),
    case("ppo-out-under-a-file", PPO, "--out", "{file}/run", says="is a file; choose another path"),
    case("ppo-out-holds-a-run", PPO, says="already holds a ppo run; add --resume", existing={"run/metrics.jsonl": ""}),
    # eval
    case("eval-k-above-n", EVAL, "--pass-k", "4", "--n", "2", says="--pass-k 4 is larger than --n 2"),
    case("eval-zero-k", EVAL, "--pass-k", "0", "--n", "2", says="eval.pass_k must be >= 1"),
    case("eval-zero-n", EVAL, "--n", "0", says="eval.n must be >= 1"),
    case("eval-zero-seeds", EVAL, "--seeds", "0", says="eval.seeds must be >= 1"),
    case("eval-negative-first-seed", EVAL, "--set", "eval.first_seed=-1", says="eval.first_seed must be >= 0"),
    case("eval-k-not-a-number", EVAL, "--pass-k", "1.5", says="Invalid value for '--pass-k'"),
    case("eval-negative-temperature", EVAL, "--temperature", "-1", says="rollout.temperature must be >= 0"),
    case("eval-unknown-env", EVAL, "--env", "nope", says="unknown env 'nope'"),
    case("eval-unknown-render-mode", EVAL, "--render-mode", "xx", says="eval.render_mode must be one of"),
    case("eval-render-mode-the-game-lacks", EVAL, "--env", "countdown",
         says="countdown has no 'coords' render mode (eval.render_mode)"),
    case("eval-prompt-mode-the-game-lacks", EVAL, "--env", NO_STATES, "--render-mode", "text", "--prompt-mode",
         "world_model", says=f"{NO_STATES} has no 'world_model' prompt mode (eval.prompt_mode)"),
    case("eval-model-missing", EVAL, "--backend", "hf", "--model", "{ws}/nothing", says="is not a built-in"),
    case("eval-model-pickled", EVAL, "--backend", "hf", "--model", "{ws}/pickled-model", says="only pickled weights"),
    case("eval-out-under-a-file", EVAL, "--out", "{file}/r.json", says="is a file; choose another path"),
    case("eval-out-is-a-dir", EVAL, "--out", "{ws}", says="is a directory"),
    case("eval-out-holds-a-run", EVAL, says="already holds a eval run; add --resume", existing={"r.json": "{}"}),
    case("eval-plot-under-a-file", EVAL, "--plot", "{file}/p.png", says=PLOT_PROBLEM),
    # eval compare
    case("compare-report-missing", ("eval", "compare", "{ws}/missing.json"), says="missing.json does not exist"),
    case("compare-report-empty", ("eval", "compare", "{ws}/empty.jsonl"), says="cannot read"),
    case("compare-report-torn", ("eval", "compare", "{ws}/torn-report.json"), says="as JSON"),
    case("compare-report-not-json", ("eval", "compare", "{ws}/bad.yaml"), says="as JSON"),
    case("compare-not-a-report", ("eval", "compare", "{traj}.manifest.json"), says="is not a spa eval report"),
    case("compare-report-other-version", ("eval", "compare", "{ws}/report-v99.json"), says="format version 99"),
    case("compare-different-settings", ("eval", "compare", "{report}", "{ws}/report-k2.json"),
         says="or pass --force"),
    case("compare-no-reports", ("eval", "compare"), says="Missing argument"),
    # pipeline, config, play, envs, the app itself
    case("pipeline-dir-under-a-file", PIPELINE, "--dir", "{file}/run", says="is a file; choose another path"),
    case("pipeline-unknown-data-policy", PIPELINE, "--set", "pipeline.data_policy=human",
         says="pipeline.data_policy must be one of"),
    case("pipeline-unknown-arm", PIPELINE, "--set", "pipeline.arms=[base, spaa]",
         says="pipeline.arms[1]: unknown arm 'spaa'; built-in arms: base,"),
    case("pipeline-arm-like-an-unknown-arm", PIPELINE, "--set", "pipeline.arms=[{name: mine, like: vagn}]",
         says="pipeline.arms[0].like: unknown arm 'vagn'"),
    case("pipeline-arm-unknown-model", PIPELINE, "--set", "pipeline.arms=[{name: mine, model: {ws}/nothing}]",
         says="arm mine: model '"),
    case("pipeline-unknown-model", PIPELINE, "--set", "model.name={ws}/nothing", says="is not a built-in name"),
    case("pipeline-arm-render-mode-the-game-lacks", PIPELINE, "--set", "env.name=countdown", "--set",
         "pipeline.arms=[vanilla_rl, state_estimation_rl]",
         says="arm state_estimation_rl: countdown has no 'coords' render mode (ppo.render_mode)"),
    case("pipeline-vagen-on-a-game-without-states", PIPELINE, "--set", f"env.name={NO_STATES}", "--set",
         "pipeline.arms=[vagen]", says=f"arm vagen: {NO_STATES} has no 'world_model' prompt mode (ppo.prompt_mode)"),
    case("pipeline-arm-sft-data-missing", PIPELINE, "--set", "pipeline.arms=[{name: mine, like: spa, "
         "sft_data: {ws}/missing.parquet}]", says="missing.parquet does not exist; give an SFT file"),
    case("pipeline-json-without-dry-run", PIPELINE, "--json", says="--json prints the plan; use it with --dry-run"),
    case("play-unknown-env", ("play", "--env", "nope"), says="unknown env 'nope'"),
    case("play-not-an-action", ("play", "--actions", "Up || Jump"), says="not an action in sokoban: 'Jump'"),
    case("play-negative-seed", ("play", "--seed", "-1"), says="--seed must be >= 0"),
    case("play-seed-not-a-number", ("play", "--seed", "x"), says="Invalid value for '--seed'"),
    case("play-unknown-render-mode", ("play", "--render-mode", "xx"), says="sokoban has no render mode 'xx'"),
    case("envs-unknown-option", ("envs", "--all"), says="No such option: --all"),
    case("envs-unknown-format", ("envs", "--format", "yaml"), says="--format must be table, json or markdown"),
    # spa plot and spa view on files of another kind, and outputs that cannot be written
    case("plot-a-report", ("plot", "{report}", "--out", "{out}/c.png"), says="spa plot expects the directory of"),
    case("plot-trajectories", ("plot", "{traj}", "--out", "{out}/c.png"), says="is not the metrics.jsonl of a spa"),
    case("plot-empty-dir", ("plot", "{ws}/no-config-model", "--out", "{out}/c.png"), says="holds no metrics.jsonl"),
    case("plot-missing", ("plot", "{ws}/missing", "--out", "{out}/c.png"), says="missing does not exist"),
    case("plot-out-is-a-dir", ("plot", "{ws}/metrics", "--out", "{ws}"), says="is a directory; give a .png"),
    case("view-metrics", ("view", "{ws}/metrics/metrics.jsonl", "--out", "{out}/v.html"),
         says="is the metrics.jsonl of a sft run"),
    case("view-sft-rows", ("view", "{sft}", "--out", "{out}/v.html"), says="holds SFT rows (spa clean)"),
    case("view-a-manifest", ("view", "{traj}.manifest.json", "--out", "{out}/v.html"),
         says="is a JSON file but not a spa eval report"),
    case("view-not-json", ("view", "{ws}/not-json.jsonl", "--out", "{out}/v.html"), says="spa view expects"),
    case("view-not-utf8", ("view", "{ws}/latin1.jsonl", "--out", "{out}/v.html"), says="is not UTF-8 text; spa view"),
    case("view-empty-dir", ("view", "{ws}/no-config-model", "--out", "{out}/v.html"), says="holds no spa run"),
    case("view-out-is-a-dir", ("view", "{traj}", "--out", "{ws}"), says="is a directory; give an .html"),
    *[case(f"{name}-out-under-proc", command, flag, "/proc/spa-test/x", says="cannot create files in /proc")
      for name, command, flag in [("generate", GENERATE, "--out"), ("clean", CLEAN, "--out"), ("sft", SFT, "--out"),
                                  ("ppo", PPO, "--out"), ("eval", EVAL, "--out"), ("pipeline", PIPELINE, "--dir"),
                                  ("eval-plot", EVAL, "--plot"), ("plot", ("plot", "{ws}/metrics"), "--out"),
                                  ("view", ("view", "{traj}"), "--out"),
                                  ("compare-plot", ("eval", "compare", "{report}"), "--plot")]],
    *[case(f"{name}-out-is-dev-null", command, "--out", "/dev/null", says="/dev/null is a device")
      for name, command in [("generate", GENERATE), ("clean", CLEAN), ("eval", EVAL), ("plot", ("plot", "{ws}/metrics")),
                            ("view", ("view", "{traj}"))]],
    case("sft-out-is-dev-null", SFT, "--out", "/dev/null", says="--out /dev/null is a file"),
    case("unknown-command", ("trian",), says="No such command 'trian'"),
]


# ---- the workspace ----------------------------------------------------------------------------------


def cli(*args: str) -> None:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """Good inputs made by the CLI itself, and bad ones made from them."""
    ws = tmp_path_factory.mktemp("bad-input")
    paths = {"ws": str(ws), "model": str(tiny_model_dir), "traj": str(ws / "traj.jsonl"),
             "sft": str(ws / "sft.jsonl"), "report": str(ws / "report.json"), "file": str(ws / "a-file")}
    cli("generate", "--backend", "random", "--groups", "2", "--group-size", "1", "--out", paths["traj"])
    cli("clean", "--data", paths["traj"], "--out", paths["sft"], "--set", "clean.val_fraction=0")
    cli("eval", "--backend", "random", "--seeds", "1", "--pass-k", "1", "--out", paths["report"])
    cli("eval", "--backend", "random", "--seeds", "1", "--pass-k", "2", "--out", str(ws / "report-k2.json"))
    write_bad_files(ws, tiny_model_dir)
    return paths


def write_bad_files(ws: Path, model: Path) -> None:
    trajectory = (ws / "traj.jsonl").read_text().splitlines()[0]
    sft_row = (ws / "sft.jsonl").read_text().splitlines()[0]
    report = json.loads((ws / "report.json").read_text())
    files = {
        "a-file": "not a directory\n",
        "empty.jsonl": "",
        "torn-traj.jsonl": f"{trajectory}\n{trajectory[:len(trajectory) // 2]}",
        "torn-sft.jsonl": f"{sft_row}\n{sft_row[:len(sft_row) // 2]}",
        "torn-report.json": json.dumps(report)[:200],
        "not-json.jsonl": "trajectory one\n",
        "wrong-keys.jsonl": '{"episode": 1}\n',
        "wrong-types.jsonl": '{"id": "a", "messages": "hello", "turns": 3}\n',
        "array.jsonl": "[1, 2]\n",
        "bad-role.jsonl": json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}) + "\n",
        "no-assistant.jsonl": json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
        "report-v99.json": json.dumps({**report, "format_version": 99}),
        "bad.yaml": "rollout: [1, 2\n",
        "list.yaml": "- rollout\n- sft\n",
        "loop.yaml": "inherit: loop.yaml\n",
        "orphan.yaml": "inherit: no-such-parent.yaml\n",
        "code.yaml": "rollout: !!python/object/apply:os.getcwd []\n",
    }
    for name, text in files.items():
        (ws / name).write_text(text, encoding="utf-8")
    (ws / "metrics").mkdir()
    (ws / "metrics" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-4}) + "\n")
    (ws / "latin1.jsonl").write_bytes('{"id": "caf\u00e9"}\n'.encode("latin-1"))
    write_parquet(ws / "wm_train.parquet", {"prompt": [[{"role": "user", "content": "hi"}]]})
    write_parquet(ws / "no-prompt.parquet", {"response": ["<think> </think> <answer>Up</answer>"]})
    (ws / "bad.parquet").write_text("prompt,response\n")
    pickled = ws / "pickled-model"
    pickled.mkdir()
    shutil.copy(model / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle; never opened
    (ws / "no-config-model").mkdir()
    (ws / "no-config-model" / "model.safetensors").write_bytes(b"")
    bare = ws / "no-tokenizer-model"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(model / name)


def write_parquet(path: Path, columns: dict[str, list]) -> None:
    """A parquet file with these columns (SPA's released data has prompt and response)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def fill(args: tuple[str, ...] | list[str], paths: dict[str, str], out: Path) -> list[str]:
    """The arguments with {ws}, {out}, {model}... replaced (other braces, as in YAML, stay)."""
    values = {**paths, "out": str(out)}
    return [re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), arg) for arg in args]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` with a hash of its bytes (directories do not count)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def assert_one_error_line(stderr: str, says: str, strict: bool = True) -> None:
    """The user-error contract on stderr; `strict=False` (subprocesses that loaded a model) lets
    libraries' own lines (progress bars, warnings) come first, but the error is the last line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert not strict or len(lines) == 1, stderr
    assert says in errors[0], (says, errors[0])


# ---- the table, in-process ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", CONFIG_CASES + STAGE_CASES, ids=lambda c: c.name)
def test_bad_input_ends_in_one_error_line_and_changes_nothing(bad, workspace, record_property):
    record_property("bad_input_case", bad.name)
    ws, out = Path(workspace["ws"]), Path(workspace["ws"]) / "out" / bad.name
    for name, text in bad.existing.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = snapshot(ws)
    args = fill(bad.args, workspace, out)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert_one_error_line(result.stderr, bad.says)
    assert_flags_exist(args, result.stderr)
    assert snapshot(ws) == before


def assert_flags_exist(args: list[str], error: str) -> None:
    """A fix the error line offers names only flags the command has (`spa sft` has no --skip-bad);
    a flag the user mistyped, which click quotes back, is no offer."""
    import typer

    command = typer.main.get_command(app)
    for arg in args:
        if not hasattr(command, "commands") or arg not in command.commands:
            break
        command = command.commands[arg]
    flags = {"--help"} | {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)}
    offered = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", error)) - {arg for arg in args if arg.startswith("--")}
    if "No such option" not in error:
        assert offered <= flags, (offered - flags, error)


# ---- faults of the machine: unreadable, read-only, full ------------------------------------------

UNREADABLE = [
    case("config-show-config-unreadable", CONFIG_SHOW, "--config", "{locked}/config.yaml", says="is not readable"),
    case("generate-config-unreadable", GENERATE, "--config", "{locked}/config.yaml", says="is not readable"),
    case("clean-data-unreadable", CLEAN, "--data", "{locked}/traj.jsonl", says="Permission denied"),
    case("sft-data-unreadable", SFT, "--data", "{locked}/sft.jsonl", says="Permission denied"),
    case("sft-model-unreadable", SFT, "--model", "{locked}/model", says="Permission denied"),
    case("compare-report-unreadable", ("eval", "compare", "{locked}/report.json"), says="is not readable"),
]
READ_ONLY = [
    case("generate-out-read-only", GENERATE, "--out", "{locked}/ro/t.jsonl", says="permission denied or read-only"),
    case("clean-out-read-only", CLEAN, "--out", "{locked}/ro/s.jsonl", says="permission denied or read-only"),
    case("sft-out-read-only", SFT, "--out", "{locked}/ro/run", says="permission denied or read-only"),
    case("ppo-out-read-only", PPO, "--out", "{locked}/ro/run", says="permission denied or read-only"),
    case("eval-out-read-only", EVAL, "--out", "{locked}/ro/r.json", says="permission denied or read-only"),
    case("pipeline-dir-read-only", PIPELINE, "--dir", "{locked}/ro/run", says="permission denied or read-only"),
]


@pytest.fixture(scope="module")
def locked(workspace, tmp_path_factory) -> Path:
    """Copies of good inputs with mode 000, and a read-only directory (mode 555)."""
    root = tmp_path_factory.mktemp("locked")
    (root / "config.yaml").write_text("rollout:\n  groups: 1\n")
    for name in ("traj.jsonl", "sft.jsonl", "report.json"):
        shutil.copy(Path(workspace["ws"]) / name, root / name)
    shutil.copytree(workspace["model"], root / "model")
    for path in [root / "config.yaml", root / "traj.jsonl", root / "sft.jsonl", root / "report.json",
                 *(root / "model").iterdir()]:
        path.chmod(0)
    (root / "ro").mkdir(mode=0o555)
    yield root
    for path in root.rglob("*"):
        path.chmod(0o755)


def run_without_privileges(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`spa args` in a subprocess for which file modes hold: as root, without the capabilities that
    bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)."""
    command = [sys.executable, "-m", "spa_cli", *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv (util-linux) is missing: cannot make file modes hold")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *command]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("bad", UNREADABLE + READ_ONLY, ids=lambda c: c.name)
def test_unreadable_input_and_read_only_output(bad, workspace, locked, record_property):
    record_property("bad_input_case", bad.name)
    ws, out = Path(workspace["ws"]), Path(workspace["ws"]) / "out" / bad.name
    before, locked_before = snapshot(ws), sorted(locked.rglob("*"))
    result = run_without_privileges(fill(bad.args, {**workspace, "locked": str(locked)}, out), cwd=ws)
    assert result.returncode == 2, result.stderr
    assert_one_error_line(result.stderr, bad.says, strict=False)
    assert snapshot(ws) == before and sorted(locked.rglob("*")) == locked_before


@pytest.mark.parametrize("bad", [
    case("generate-disk-full", GENERATE, says="No space left on device"),
    case("clean-disk-full", CLEAN, says="No space left on device"),
    case("eval-disk-full", EVAL, says="No space left on device"),
], ids=lambda c: c.name)
def test_a_full_disk_injected_in_process_leaves_nothing(bad, workspace, monkeypatch, record_property):
    record_property("bad_input_case", bad.name)
    ws, out = Path(workspace["ws"]), Path(workspace["ws"]) / "out" / bad.name
    before = snapshot(ws)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    result = runner.invoke(app, fill(bad.args, workspace, out))
    monkeypatch.undo()
    assert result.exit_code == 2, (result.output, result.exception)
    assert_one_error_line(result.stderr, bad.says)
    assert str(out) in result.stderr  # the line names the file that could not be written
    assert snapshot(ws) == before


def test_a_checkpoint_write_that_safetensors_fails_is_the_os_error_it_names(tmp_path):
    from safetensors import SafetensorError

    from stages.training.checkpoints import write_pretrained

    class Failing:
        def save_pretrained(self, path, **kwargs):
            (Path(path) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as raised:
        write_pretrained(Failing(), None, tmp_path / "final")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "final")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


# ---- a real full disk: a tiny tmpfs in a user + mount namespace ------------------------------------


def can_mount_tmpfs(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    script = f"mount -t tmpfs -o size=4k tmpfs {shlex.quote(str(probe))}"
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                              capture_output=True, timeout=30, check=False)
    except FileNotFoundError:
        return False
    return done.returncode == 0


@dataclass
class TinyDisk:
    """Runs `spa` commands with their output on a tmpfs of `size`, which lives as long as the
    namespace: each run's stderr and exit code, and copies of the disk, land in `results`."""

    results: Path
    disk: Path
    size: str
    steps: list[str] = field(default_factory=list)

    def spa(self, name: str, args: list[str]) -> None:
        command = shlex.join([sys.executable, "-m", "spa_cli", *args])
        where = shlex.quote(str(self.results / name))
        self.steps.append(f"{command} >{where}.out 2>{where}.err; echo $? >{where}.rc")

    def copy(self, name: str) -> None:
        target = shlex.quote(str(self.results / name))
        self.steps.append(f"mkdir {target} && cp -a {shlex.quote(str(self.disk))}/. {target}/")

    def grow(self, size: str) -> None:
        self.steps.append(f"mount -o remount,size={size} {shlex.quote(str(self.disk))}")

    def run(self) -> None:
        mount = f"mount -t tmpfs -o size={self.size} tmpfs {shlex.quote(str(self.disk))}"
        script = " && ".join([mount, *(f"{{ {step}; }}" for step in self.steps)])
        subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       timeout=600, check=True)

    def outcome(self, name: str) -> tuple[int, str]:
        return int((self.results / f"{name}.rc").read_text()), (self.results / f"{name}.err").read_text()


@pytest.fixture
def tiny_disk(tmp_path):
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("no user + mount namespace here (unshare -Urm fails): the real full disk is not tested")
    (tmp_path / "disk").mkdir()
    (tmp_path / "results").mkdir()
    return lambda size: TinyDisk(tmp_path / "results", tmp_path / "disk", size)


def assert_only_whole_files(root: Path) -> None:
    """What a failed run may leave: no temp file or directory, and every JSON / JSONL / safetensors
    file whole."""
    from safetensors.torch import load_file

    for path in root.rglob("*"):
        assert not path.name.startswith("."), f"temp file left behind: {path}"
        if path.suffix == ".safetensors":
            load_file(path)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            text = path.read_text()
            assert text == "" or text.endswith("\n"), f"torn last line in {path}"
            for line in text.splitlines():
                json.loads(line)


def test_generate_on_a_full_disk_keeps_whole_episodes_and_resumes(tiny_disk, workspace, record_property):
    record_property("bad_input_case", "generate-real-disk-full")
    disk = tiny_disk("32k")  # the manifest and 3 of the 8 episodes (~7 kB each) fit
    args = ["generate", "--backend", "random", "--groups", "4", "--group-size", "2", "--resume", "--out",
            f"{disk.disk}/t.jsonl"]
    disk.spa("full", args)
    disk.copy("after-full")
    disk.grow("1m")
    disk.spa("resumed", args)
    disk.copy("after-resume")
    disk.run()
    code, stderr = disk.outcome("full")
    assert code == 2, stderr
    # the episodes finished before the disk filled show as progress lines, then the error
    assert_one_error_line(stderr, f"No space left on device: {disk.disk}/t.jsonl", strict=False)
    kept = disk.results / "after-full"
    assert_only_whole_files(kept)
    assert 0 < len((kept / "t.jsonl").read_text().splitlines()) < 8
    assert disk.outcome("resumed")[0] == 0
    reference = Path(workspace["ws"]) / "out" / "generate-reference.jsonl"
    cli(*args[:-1], str(reference))
    resumed = [json.loads(line) for line in (disk.results / "after-resume" / "t.jsonl").read_text().splitlines()]
    assert sorted(resumed, key=lambda row: row["id"]) == sorted(
        (json.loads(line) for line in reference.read_text().splitlines()), key=lambda row: row["id"])


@pytest.mark.parametrize("bad, size", [
    (case("clean-real-disk-full", CLEAN, "--out", "{disk}/s.jsonl", says="No space left on device"), "8k"),
    (case("eval-real-disk-full", EVAL, "--seeds", "4", "--pass-k", "2", "--out", "{disk}/r.json",
          says="No space left on device"), "16k"),
    (case("sft-real-disk-full", SFT, "--out", "{disk}/run", "--set", "sft.save_every_steps=1",
          says="No space left on device"), "20m"),
    (case("ppo-real-disk-full", PPO, "--out", "{disk}/run", "--steps", "2", "--set", "ppo.save_every=1",
          "--set", "ppo.val_every=0", "--set", "rollout.max_new_tokens=4", "--set", "rollout.max_turns=1",
          says="No space left on device"), "20m"),
], ids=lambda value: value.name if isinstance(value, Case) else value)
def test_a_real_full_disk_is_one_error_line_and_leaves_whole_files(bad, size, tiny_disk, workspace,
                                                                    record_property):
    record_property("bad_input_case", bad.name)
    disk = tiny_disk(size)
    disk.spa("run", fill(bad.args, {**workspace, "disk": str(disk.disk)}, disk.disk))
    disk.copy("after")
    disk.run()
    code, stderr = disk.outcome("run")
    assert code == 2, stderr
    assert_one_error_line(stderr, bad.says, strict=False)
    assert_only_whole_files(disk.results / "after")

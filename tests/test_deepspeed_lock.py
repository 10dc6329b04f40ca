"""DeepSpeed builds its CPU op under a lock file the first time; a run never waits on it silently.

A build killed half-way leaves the lock behind, and torch's loader then waits forever with no
word. The one engine setup (`stages.training.engine.setup_distributed`) removes a lock that no
live process builds under, and otherwise waits with a message and a timeout that names the file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stages.common.errors import UserError
from stages.training import engine as eng


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """An empty torch extensions root of our own: the op's build directory under it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build = eng.op_build_dir()
    assert build == tmp_path / "ext" / eng.SHM_OP and build.is_dir()
    return build


def test_a_stale_lock_is_removed_with_a_message(extensions, capsys):
    lock = extensions / "lock"
    lock.write_text("")
    eng.wait_for_op_build(timeout_s=30, grace_s=0.3)
    assert not lock.exists()
    assert capsys.readouterr().out == (f"removed {lock}: an interrupted DeepSpeed op build left it, and no "
                                       "process is building\n")


def test_a_live_build_is_waited_for_with_a_message_then_refused_naming_the_file(extensions, capsys):
    lock = extensions / "lock"
    lock.write_text("")
    builder = subprocess.Popen(["sleep", "60"], cwd=extensions)  # what ninja and the compiler look like
    try:
        with pytest.raises(UserError) as err:
            eng.wait_for_op_build(timeout_s=1.5, grace_s=0.2)
    finally:
        builder.kill()
        builder.wait()
    assert lock.exists()  # never removed under a live build
    assert str(err.value).startswith(f"DeepSpeed's op build has held {lock} for ")
    assert str(err.value).endswith("remove that file and run the command again")
    assert capsys.readouterr().out.startswith("waiting for another process's build of DeepSpeed's "
                                              f"deepspeed_shm_comm op (lock {lock}; ")


def test_no_lock_returns_at_once(extensions, capsys):
    eng.wait_for_op_build(timeout_s=0, grace_s=0)
    assert capsys.readouterr().out == ""


def test_cpu_adam_is_built_only_after_a_stale_lock_of_its_own_is_removed(tmp_path, monkeypatch, capsys):
    """Optimizer offload builds DeepSpeed's CPU Adam on every rank at its first use: a lock a killed
    build left in that op's build directory is removed before the build starts, not waited on."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as setup_distributed sets it: no accelerator probe warning
    import deepspeed.ops.adam
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(eng, "OP_BUILD_GRACE_S", 0.3)
    lock = eng.op_build_dir(eng.CPU_ADAM_OP) / "lock"
    assert lock.parent == tmp_path / "ext" / "cpu_adam"
    lock.write_text("")
    locked_at_build = []
    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam",
                        lambda params, **_: locked_at_build.append(lock.exists()))
    settings = eng.OptimSettings(1e-3, (0.9, 0.999), 0.0, 1.0, 10, 0.0)
    eng._optimizer(torch.nn.Linear(2, 2), settings, "cuda", cpu_adam=True)
    assert locked_at_build == [False]
    assert capsys.readouterr().out == (f"removed {lock}: an interrupted DeepSpeed op build left it, and no "
                                       "process is building\n")


def test_deepspeed_starts_despite_a_planted_stale_lock(tmp_path):
    """The real start of DeepSpeed on the CPU, in a child process, with the op already built (make
    install builds it) and a stale lock planted in its build directory: it starts and says so."""
    built = eng.op_build_dir()
    if not (built / f"{eng.SHM_OP}.so").is_file():
        pytest.skip("DeepSpeed's CPU op is not built on this machine yet (make install builds it)")
    root = tmp_path / "ext"
    shutil.copytree(built, root / eng.SHM_OP)  # copy2 keeps the times: ninja finds it up to date
    (root / eng.SHM_OP / "lock").write_text("")
    code = "from stages.training.engine import setup_distributed; print(setup_distributed('cpu', True))"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert f"removed {root / eng.SHM_OP / 'lock'}" in result.stdout and "Dist(rank=0, world=1" in result.stdout


@pytest.fixture
def deepspeed_missing(monkeypatch):
    """DeepSpeed looks uninstalled, as after the demo's install."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))


def test_zero_without_deepspeed_installed_stops_with_one_line_and_plain_torch_needs_none(monkeypatch,
                                                                                        deepspeed_missing):
    """DeepSpeed is an optional extra: ZeRO without it is refused before anything starts, with how
    to install it or train without it; plain torch in one process never asks for it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match=r"trains with DeepSpeed, which is not installed; install it with pip install "
                                        r"-e '\.\[deepspeed\]' .*sft\.zero_stage=0 / ppo\.zero_stage=0"):
        eng.setup_distributed("cpu", use_deepspeed=True)
    assert eng.setup_distributed("cpu", use_deepspeed=False).world == 1


def test_a_pipeline_with_a_zero_stage_needs_deepspeed_before_its_first_stage(tmp_path, deepspeed_missing):
    from stages import pipeline
    from stages.common.config import load_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    config = load_config(demo, [f"pipeline.dir={tmp_path / 'run'}", "sft.zero_stage=2"])
    with pytest.raises(UserError, match="trains with DeepSpeed, which is not installed"):
        pipeline.run(config)
    assert not (tmp_path / "run").exists()

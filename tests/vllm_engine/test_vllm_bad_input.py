"""Bad input for the vllm backend through the real command line: vLLM missing, a model vLLM cannot
load, a KV cache larger than the machine. Each ends as every user error does (tests/test_bad_input.py):
exit code 2, one `error:` line naming the fix, no traceback, and nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from spa_cli.main import app

runner = CliRunner()

GENERATE = ("generate", "--backend", "vllm", "--groups", "1", "--group-size", "1", "--out", "{out}/t.jsonl")
EVAL = ("eval", "--backend", "vllm", "--seeds", "1", "--pass-k", "1", "--out", "{out}/r.json")
PPO = ("ppo", "--out", "{out}/run", "--set", "rollout.backend=vllm", "--set", "rollout.groups=2", "--set",
       "rollout.group_size=2", "--set", "ppo.filter_ratio=1.0", "--set", "ppo.mini_batch=2")
PIPELINE = ("pipeline", "--dir", "{out}/run", "--set", "rollout.backend=vllm", "--set", "pipeline.data_policy=random")
MISSING = "the vllm backend needs vLLM, which is not installed; on a CPU machine `make install` brings it"
TOO_LARGE = "rollout.kv_cache_gb=100000 is more than the"

CASES = [
    *[(f"{command[0]}-without-vllm", (*command, "--set", "model.name={tiny}"), MISSING)
      for command in (GENERATE, EVAL, PPO, PIPELINE)],
    ("generate-architecture-vllm-lacks", (*GENERATE, "--set", "model.name={ws}/alien"),
     "vLLM cannot load {ws}/alien: its architecture (SpaAlienForCausalLM) is not one vLLM implements"),
    *[(f"{command[0]}-kv-cache-larger-than-the-machine",
       (*command, "--set", "model.name={tiny}", "--set", "rollout.kv_cache_gb=100000"), TOO_LARGE)
      for command in (GENERATE, EVAL, PPO, PIPELINE)],
]
if not torch.cuda.is_available():  # CUDA kernels take this head size
    CASES.append(("generate-head-size-the-cpu-kernels-lack", (*GENERATE, "--set", "model.name={ws}/small-heads"),
                  "vLLM could not run {ws}/small-heads: Unsupported CPU attention configuration: head_dim=16"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir, vllm_tiny_dir) -> Path:
    ws = tmp_path_factory.mktemp("ws")
    alien = ws / "alien"  # vLLM has no such architecture
    shutil.copytree(vllm_tiny_dir, alien)
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**config, "architectures": ["SpaAlienForCausalLM"]}))
    shutil.copytree(tiny_model_dir, ws / "small-heads")  # the suite's tiny model: head size 16
    return ws


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name, command, says", CASES, ids=[case[0] for case in CASES])
def test_bad_input_ends_in_one_error_line_and_writes_nothing(name, command, says, workspace, vllm_tiny_dir,
                                                             monkeypatch, record_property):
    record_property("bad_input_case", name)
    if "without-vllm" in name:
        monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    fill = {"{ws}": str(workspace), "{tiny}": str(vllm_tiny_dir), "{out}": str(workspace / "out" / name)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    before = snapshot(workspace)
    result = runner.invoke(app, [filled(arg) for arg in command])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    assert filled(says) in lines[0], lines[0]
    assert snapshot(workspace) == before

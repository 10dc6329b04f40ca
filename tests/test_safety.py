"""Nothing a model, a data file or a checkpoint holds runs as code, and nothing read from data
decides where spa writes.

* A scan of the toolkit's source (stages/, envs/, spa_cli/) for the calls that would let it:
  eval/exec, unpickling, torch.load without weights_only=True, YAML beyond safe_load,
  trust_remote_code=True, use_safetensors=False, shells. The scanner is tested on code that has
  each of them, so the scan can fail.
* The same properties end to end: a "model" whose pytorch_model.bin would create a file when
  unpickled, a trainer state (plain torch and DeepSpeed) carrying the same payload, a YAML config
  with a python tag, a model answer that is Python and shell, and data ids that are paths.
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from spa_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("stages", "envs", "spa_cli") for p in (ROOT / folder).rglob("*.py"))
runner = CliRunner()


# ---- the source scan -----------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    """`torch.load` for the expression torch.load, "" for anything that is not a plain name chain."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword(call: ast.Call, name: str) -> object:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value.value if isinstance(keyword.value, ast.Constant) else "<computed>"
    return "<absent>"


UNSAFE_CALLS = {
    "eval": "runs text as code", "exec": "runs text as code", "compile": "compiles text to code",
    "__import__": "imports a module named by a string",
    "pickle.load": "unpickles", "pickle.loads": "unpickles", "pickle.Unpickler": "unpickles",
    "dill.load": "unpickles", "dill.loads": "unpickles", "joblib.load": "unpickles",
    "yaml.load": "may build Python objects", "yaml.unsafe_load": "builds Python objects",
    "yaml.full_load": "may build Python objects", "yaml.load_all": "may build Python objects",
    "os.system": "runs a shell", "os.popen": "runs a shell",
}


def unsafe_calls(source: str) -> list[str]:
    """Each call in `source` that could run what data holds, as "line N: what (why)"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in UNSAFE_CALLS:
            found.append(f"line {node.lineno}: {name} ({UNSAFE_CALLS[name]})")
        if name == "torch.load" and _keyword(node, "weights_only") is not True:
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        if _keyword(node, "trust_remote_code") is True:
            found.append(f"line {node.lineno}: trust_remote_code=True")
        if _keyword(node, "use_safetensors") is False:
            found.append(f"line {node.lineno}: use_safetensors=False")
        if _keyword(node, "shell") is True:
            found.append(f"line {node.lineno}: shell=True")
        if name.endswith("load") and _dotted_loader(node) in ("yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader"):
            found.append(f"line {node.lineno}: a YAML loader that builds Python objects")
    return found


def _dotted_loader(call: ast.Call) -> str:
    for keyword in call.keywords:
        if keyword.arg == "Loader":
            return _dotted(keyword.value)
    return ""


def test_the_scanner_finds_every_unsafe_call():
    bad = """
import pickle, yaml, torch, os, subprocess
eval("1"); exec("x = 1"); compile("1", "f", "eval"); __import__("os")
pickle.loads(b""); pickle.load(f); yaml.load(text); yaml.unsafe_load(text); yaml.full_load(text)
yaml.load(text, Loader=yaml.Loader)
torch.load(p); torch.load(p, weights_only=False); torch.load(p, weights_only=flag)
AutoModel.from_pretrained(p, trust_remote_code=True, use_safetensors=False)
os.system("ls"); subprocess.run("ls", shell=True)
"""
    assert len(unsafe_calls(bad)) == 18
    fine = """
yaml.safe_load(text); torch.load(p, weights_only=True); model.eval(); AutoModel.from_pretrained(p,
trust_remote_code=config.trust_remote_code, use_safetensors=True); pickle.UnpicklingError
"""
    assert unsafe_calls(fine) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_toolkit_never_runs_what_data_holds(path):
    assert unsafe_calls(path.read_text(encoding="utf-8")) == []


def test_remote_code_is_off_unless_the_config_turns_it_on(tiny_model_dir, monkeypatch):
    import transformers

    from stages.common.config import ModelConfig
    from stages.common.models import load_model

    assert ModelConfig().trust_remote_code is False
    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(cls, *args, _original=original, **kwargs):
            seen.append((cls.__name__, kwargs.get("trust_remote_code"), kwargs.get("use_safetensors")))
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    load_model(ModelConfig(name=str(tiny_model_dir), device="cpu"))
    assert seen == [("AutoModelForCausalLM", False, True), ("AutoTokenizer", False, None)]
    seen.clear()
    load_model(ModelConfig(name=str(tiny_model_dir), device="cpu", trust_remote_code=True))
    assert [remote for _, remote, _ in seen] == [True, True]


# ---- payloads that would run if unpickled -------------------------------------------------------


class Payload:
    """Unpickling this creates `marker` (an `open(marker, "w")` call): proof that a load ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_model_with_pickled_weights_only_is_refused_unopened(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    marker = tmp_path / "ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    result = runner.invoke(app, ["eval", "--model", str(model), "--seeds", "1", "--pass-k", "1", "--out",
                                 str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: model directory {model} has only pickled weights (pytorch_model.bin)")
    assert "safetensors only" in result.stderr
    assert not marker.exists()


def spy_on_torch_load(monkeypatch) -> list[object]:
    calls = []
    original = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def engine_and_state(tiny_model_dir, zero_stage: int):
    from stages.common.config import ModelConfig
    from stages.common.models import load_model
    from stages.training import engine as eng

    dist = eng.setup_distributed("cpu", use_deepspeed=zero_stage > 0)
    model, _ = load_model(ModelConfig(name=str(tiny_model_dir), device="cpu", dtype="float32"))
    settings = eng.OptimSettings(1e-3, (0.9, 0.95), 0.0, 1.0, total_steps=4, warmup_ratio=0.0)
    engine = eng.build_engine(model, settings, dist, zero_stage)
    ids = torch.tensor([[1, 2, 3, 4]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["plain-torch", "deepspeed-zero2"])
def test_trainer_states_load_weights_only_and_refuse_a_payload(zero_stage, tiny_model_dir, tmp_path, monkeypatch):
    from stages.common.errors import UserError

    engine = engine_and_state(tiny_model_dir, zero_stage)
    client = {"progress": {"step": 1, "loss": 0.5, "last": {"lr": None}}, "rng": torch.get_rng_state()}
    engine.save_state(tmp_path / "state", client)
    before = [p.detach().clone() for p in engine.module.parameters()]
    calls = spy_on_torch_load(monkeypatch)
    loaded = engine.load_state(tmp_path / "state")
    assert calls and all(flag is True for flag in calls), calls
    assert loaded["progress"] == client["progress"] and torch.equal(loaded["rng"], client["rng"])
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))

    marker = tmp_path / "ran"
    for path in (tmp_path / "state").rglob("*.pt"):
        torch.save({"payload": Payload(marker)}, path)
    with pytest.raises(UserError, match=r"holds more than tensors and plain values .* does not unpickle"):
        engine.load_state(tmp_path / "state")
    assert not marker.exists()


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["plain-torch", "deepspeed-zero2"])
def test_a_state_saved_for_another_module_layout_is_one_line(zero_stage, tiny_model_dir, tmp_path):
    """A state whose weights are named for another wrapping of the model (spa sft trains a StepPolicy
    around the model, whose weights are named lm.*) is refused in one line, not torch's key list."""
    from stages.common.config import ModelConfig
    from stages.common.errors import UserError
    from stages.common.models import load_model
    from stages.training import engine as eng

    engine_and_state(tiny_model_dir, zero_stage).save_state(tmp_path / "state", {})
    model, _ = load_model(ModelConfig(name=str(tiny_model_dir), device="cpu", dtype="float32"))
    settings = eng.OptimSettings(1e-3, (0.9, 0.95), 0.0, 1.0, total_steps=4, warmup_ratio=0.0)
    dist = eng.setup_distributed("cpu", use_deepspeed=zero_stage > 0)
    wrapped = eng.build_engine(torch.nn.ModuleDict({"lm": model}), settings, dist, zero_stage)
    with pytest.raises(UserError, match=r"^\S+state holds a training state whose weights do not fit this model "
                                        r"\(Error\(s\) in loading state_dict for ModuleDict:\); start the run "
                                        r"again without --resume, or resume it with the spa version that saved it$"):
        wrapped.load_state(tmp_path / "state")


# ---- configs and model answers ------------------------------------------------------------------


def test_a_yaml_config_with_a_python_tag_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"rollout:\n  groups: !!python/object/apply:os.system ['touch {marker}']\n")
    result = runner.invoke(app, ["config", "show", "--config", str(config)])
    assert result.exit_code == 2 and "is not valid YAML" in result.stderr
    tagged = f"!!python/object/apply:os.system ['touch {marker}']"
    result = runner.invoke(app, ["config", "show", "--set", f"model.name={tagged}"])
    assert result.exit_code == 0
    assert yaml.safe_load(result.stdout)["model"]["name"] == tagged  # kept as a plain string
    assert not marker.exists()


def test_a_model_answer_that_is_code_is_an_invalid_action_and_never_runs(tmp_path):
    import envs
    from stages.agent.backends.base import Completion
    from stages.agent.proxy import play
    from stages.common.config import SPAConfig

    marker = tmp_path / "ran"
    answers = [f"__import__('os').system('touch {marker}')", f"$(touch {marker})", f"`touch {marker}`",
               f"open('{marker}', 'w')", "{{ cycler.__init__.__globals__.os.popen('id') }}"]

    class Scripted:
        name = "scripted"

        def generate(self, requests, params, progress=None):
            return [Completion([], f"<observation>x</observation> t <prediction>x</prediction> </think> "
                                   f"<answer>{' || '.join(answers)}</answer>") for _ in requests]

        def release(self, keys):
            pass

    for env in ("sokoban", "frozen_lake", "sudoku"):
        config = SPAConfig()
        config.env.name = env
        config.rollout.max_turns = 1
        [episode] = play(config.env, config.rollout, Scripted(), [0], 1, prompt_mode="world_model",
                         render_mode="coords")
        assert episode.turns[0].executed == [] and not any(episode.turns[0].action_valid), env
        assert all(envs.make(env).parse_action(answer) is None for answer in answers)
    assert not marker.exists()


# ---- data decides no path -------------------------------------------------------------------------


def test_ids_that_are_paths_do_not_move_any_output(tmp_path, tiny_model_dir):
    """Trajectory and row ids such as ../../x become file names nowhere: every file the stages
    write lands under their --out."""
    work = tmp_path / "deep" / "work"
    work.mkdir(parents=True)
    trajectories = work / "t.jsonl"
    assert runner.invoke(app, ["generate", "--backend", "random", "--groups", "2", "--group-size", "1",
                               "--out", str(trajectories)]).exit_code == 0
    rows = [json.loads(line) for line in trajectories.read_text().splitlines()]
    hostile = ["../../escaped", f"{tmp_path}/escaped-absolute"]
    for row, row_id in zip(rows, hostile):
        row["id"] = row_id
    data = work / "hostile.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = {p for p in tmp_path.rglob("*")}
    outputs = [work / "clean", work / "sft", work / "resumed"]
    commands = [
        ["clean", "--data", str(data), "--out", str(outputs[0] / "rows.jsonl"), "--unit", "turn",
         "--set", "clean.val_fraction=0.5"],
        ["sft", "--data", str(outputs[0] / "rows.jsonl"), "--model", str(tiny_model_dir), "--out", str(outputs[1]),
         "--dry-run"],
    ]
    for command in commands:
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    # a generate resumed into a file whose ids are paths: they are only compared, never used as names
    outputs[2].mkdir()
    resumed = outputs[2] / "t.jsonl"
    resumed.write_text(data.read_text())
    (outputs[2] / "t.jsonl.manifest.json").write_text((work / "t.jsonl.manifest.json").read_text())
    assert runner.invoke(app, ["generate", "--backend", "random", "--groups", "2", "--group-size", "1",
                               "--out", str(resumed), "--resume"]).exit_code == 0
    new = {p for p in tmp_path.rglob("*")} - before
    assert new and all(any(out in p.parents or p == out for out in outputs) for p in new), sorted(new)
    for place in (tmp_path, tmp_path.parent, Path.cwd().parent, Path.cwd().parent.parent):
        assert not list(place.glob("escaped*")) and not list(tmp_path.rglob("escaped*"))
    cleaned = [json.loads(line) for line in (outputs[0] / "rows.jsonl").read_text().splitlines()]
    assert {row["source_id"] for row in cleaned} <= set(hostile) and cleaned  # the ids did flow through
    assert (outputs[1] / "dry_run.txt").is_file()

"""The config system: defaults, inheritance, overrides, and one-line errors that name the key."""

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import yaml

from stages.common import config_docs
from stages.common.config import SPAConfig, TrainingConfig, load_config, to_dict, to_yaml
from stages.common.errors import UserError
from stages.training.engine import deepspeed_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def dotted_keys(config: dict) -> set[str]:
    """`section.key` for every key of every section, and the top-level settings by name."""
    return {f"{name}.{key}" for name, value in config.items() if isinstance(value, dict) for key in value} | {
        name for name, value in config.items() if not isinstance(value, dict)}


def test_base_yaml_spells_out_every_key_with_its_default():
    written = yaml.safe_load((CONFIGS / "base.yaml").read_text(encoding="utf-8"))
    schema = to_dict(SPAConfig())
    assert sorted(dotted_keys(schema) - dotted_keys(written)) == [], "keys of the schema missing from base.yaml"
    assert sorted(dotted_keys(written) - dotted_keys(schema)) == [], "keys of base.yaml the schema does not have"
    differ = sorted(key for key in dotted_keys(schema) if _value(written, key) != _value(schema, key))
    assert differ == [], "base.yaml values that are not the schema's defaults"


def _value(config: dict, key: str):
    section, _, name = key.partition(".")
    return config[section][name] if name else config[section]


def test_the_key_sets_are_compared_both_ways():
    schema = to_dict(SPAConfig())
    fewer = {**schema, "ppo": {k: v for k, v in schema["ppo"].items() if k != "steps"}}
    more = {**schema, "ppo": {**schema["ppo"], "no_such_key": False}}
    assert dotted_keys(schema) - dotted_keys(fewer) == {"ppo.steps"}
    assert dotted_keys(more) - dotted_keys(schema) == {"ppo.no_such_key"}


def test_the_configuration_page_is_written_from_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == config_docs.reference(), (
        f"docs/configuration.md differs from the schema; run: {config_docs.COMMAND}")


def test_every_setting_says_what_it_is_for_and_every_key_is_on_the_page():
    page = config_docs.reference()
    sections = [f for f in dataclasses.fields(SPAConfig) if dataclasses.is_dataclass(getattr(SPAConfig(), f.name))]
    for section in sections:
        cls = type(getattr(SPAConfig(), section.name))
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls  # its own docstring
        for f in dataclasses.fields(cls):
            assert f.metadata["help"].strip(), f"{section.name}.{f.name} has no help"
            assert f"| `{section.name}.{f.name}` |" in page
    assert "| `quiet` |" in page


def test_sft_and_ppo_declare_their_training_settings_once():
    shared = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert {"zero_stage", "offload", "deepspeed_config", "gradient_checkpointing", "lora_rank"} <= shared
    for section in (SPAConfig().sft, SPAConfig().ppo):
        assert isinstance(section, TrainingConfig)
        own = set(inspect.get_annotations(type(section)))
        assert own & shared == set(), f"{type(section).__name__} declares {own & shared} again"
    assert load_config(None, ["sft.offload=true", "ppo.zero_stage=3"]).ppo.zero_stage == 3


@pytest.mark.parametrize("setting, on_cuda, processes, trained", [
    ("auto", False, 1, 0),  # one CPU process: nothing to shard, plain torch
    ("auto", False, 2, 2),  # a launcher's ranks on the CPU
    ("auto", True, 1, 2),  # a GPU: DeepSpeed's bf16 mode
    ("auto", True, 8, 2),
    (3, False, 1, 3),  # a stage that is asked for is trained as asked
    (0, True, 1, 0),
])
def test_zero_stage_auto_is_plain_torch_only_for_one_cpu_process(setting, on_cuda, processes, trained):
    section = load_config(None, [f"sft.zero_stage={setting}"]).sft
    assert section.engine_stage(on_cuda=on_cuda, processes=processes) == trained


@pytest.mark.parametrize("hint, bounds, type_text, accepted", [
    ("int", {"ge": 1}, "integer", ">= 1"),
    ("float | None", {"gt": 0, "le": 1}, "number or null", "> 0 and <= 1"),
    ("list[float]", {"ge": 0, "lt": 1}, "list of number", ">= 0 and < 1"),
    ('Literal["a", "b"]', {}, "choice", "`a` | `b`"),
    ('list[Literal["none", "wandb"]]', {}, "list of choice", "`none` | `wandb`"),
    ("list[str | dict[str, Any]]", {}, "list of text or mapping", ""),
    ("Literal[0, 1, 2, 3]", {}, "choice", "`0` | `1` | `2` | `3`"),
    ("bool | None", {}, "true/false or null", ""),
])
def test_the_page_writes_types_and_accepted_values(hint, bounds, type_text, accepted):
    from typing import Any, Literal  # noqa: F401 - for eval

    parsed = eval(hint)
    assert config_docs.type_text(parsed) == type_text
    assert config_docs.accepted(parsed, bounds) == accepted


@pytest.mark.parametrize("path", sorted([*CONFIGS.rglob("*.yaml"), *(ROOT / "experiments").rglob("*.yaml")]),
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_every_shipped_config_names_only_settings_of_the_schema(path):
    load_config(path)


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake", "sudoku"])
def test_env_configs_inherit_base(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.env.name == name
    assert config.rollout == SPAConfig().rollout


def test_inheritance_merges_sections_key_by_key(tmp_path):
    (tmp_path / "parent.yaml").write_text("rollout: {groups: 3, group_size: 2}\nsft: {epochs: 1}\n")
    (tmp_path / "child.yaml").write_text("inherit: parent.yaml\nrollout: {groups: 7}\n")
    config = load_config(tmp_path / "child.yaml")
    assert (config.rollout.groups, config.rollout.group_size, config.sft.epochs) == (7, 2, 1)


def test_overrides_apply_in_order_and_are_typed():
    config = load_config(None, ["rollout.groups=4", "sft.betas=[0.8, 0.9]", "sft.lr=3e-4",
                                "env.options={num_boxes: 2}", "eval.n=null"],
                         {"rollout.groups": 5})
    assert config.rollout.groups == 5
    assert config.sft.betas == [0.8, 0.9]
    assert config.sft.lr == 3e-4
    assert config.env.options == {"num_boxes": 2}
    assert config.eval.n is None


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["sft.lr=1"]).sft.lr == 1.0
    with pytest.raises(UserError, match=r"^rollout.groups must be an integer, got 2.5"):
        load_config(None, ["rollout.groups=2.5"])


@pytest.mark.parametrize("override, message", [
    ("rollout.grups=3", r"unknown config key 'rollout.grups'; valid keys here: backend, .* Did you mean 'groups'\?"),
    ("rolout.groups=3", r"unknown config key 'rolout'; .* Did you mean 'rollout'\?"),
    ("eval.prompt_mode=world", (r"eval.prompt_mode must be one of world_model, base; got 'world'. "
                                r"Did you mean 'world_model'\?")),
    ("rollout.prompt_mode=base", r"unknown config key 'rollout.prompt_mode'"),  # each stage has its own
    ("env.render_mode=text", r"unknown config key 'env.render_mode'"),
    ("rollout.groups=many", r"rollout.groups must be an integer, got 'many' \(str\)"),
    ("quiet=1", r"quiet must be true or false"),
    ("sft.betas=0.9", r"sft.betas must be a list"),
    ("rollout=3", r"rollout must be a mapping"),
    ("novalue", r"--set expects key.path=value"),
])
def test_bad_overrides_fail_with_one_line(override, message):
    with pytest.raises(UserError, match=message) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  groups: [1, 2\n")
    with pytest.raises(UserError, match=r"bad.yaml is not valid YAML at line \d+"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must be a mapping of sections"):
        load_config(tmp_path / "list.yaml")


def test_inheritance_cycle_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(UserError, match="inherits from itself"):
        load_config(tmp_path / "a.yaml")


def test_yaml_round_trip(tmp_path):
    config = load_config(None, ["rollout.groups=2", "env.name=sudoku"])
    path = tmp_path / "round.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("quiet: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("file_stage, setting, trained", [(3, "auto", 3), (1, 2, 1), (3, 0, 0)])
def test_the_engine_stage_is_the_deepspeed_files_own_under_deepspeed(tmp_path, file_stage, setting, trained):
    """The engine keeps a user DeepSpeed file's stage (`engine.deepspeed_config`); what the run records
    and plans (a ZeRO-3 run's unsharded generator copy) must name that stage too. Plain torch (0)
    reads no file."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": file_stage}}))
    section = load_config(None, [f"ppo.zero_stage={setting}", f"ppo.deepspeed_config={path}"]).ppo
    assert section.engine_stage(on_cuda=True, processes=1) == trained
    assert deepspeed_config(trained, False, 1.0, "cuda", "bf16", str(path))["zero_optimization"]["stage"] == file_stage


@pytest.mark.parametrize("kind", ["sft", "ppo"])
@pytest.mark.parametrize("contents", [{}, {"zero_optimization": {"overlap_comm": "auto"}}])
@pytest.mark.parametrize("setting, trained", [("auto", 2), (1, 1), (3, 3)])
def test_a_deepspeed_file_naming_no_stage_trains_the_settings_stage(tmp_path, kind, contents, setting, trained):
    """A user DeepSpeed file without zero_optimization.stage leaves `zero_stage` in force: the stage
    recorded and planned, and the one the engine writes into the file's settings (not DeepSpeed's
    own default, 0)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(contents))
    section = getattr(load_config(None, [f"{kind}.zero_stage={setting}", f"{kind}.deepspeed_config={path}"]), kind)
    assert section.engine_stage(on_cuda=True, processes=1) == trained
    assert deepspeed_config(trained, False, 1.0, "cuda", "bf16", str(path))["zero_optimization"]["stage"] == trained


@pytest.mark.parametrize("stage", ["auto", 4, "2", True])
def test_a_deepspeed_file_naming_no_zero_stage_is_one_line(tmp_path, stage):
    """DeepSpeed reads zero_optimization.stage as an integer 0-3 ("auto" is transformers' word, not
    DeepSpeed's): anything else is refused before training, in one line."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    section = load_config(None, ["ppo.zero_stage=2", f"ppo.deepspeed_config={path}"]).ppo
    with pytest.raises(UserError, match=r"zero_optimization.stage is .*; set it to 0, 1, 2 or 3, or leave it out "
                                        r"to train at zero_stage 2$"):
        section.engine_stage(on_cuda=True, processes=1)


def test_an_unreadable_deepspeed_file_is_one_line(tmp_path):
    section = load_config(None, [f"ppo.deepspeed_config={tmp_path / 'missing.json'}"]).ppo
    with pytest.raises(UserError, match=r"^DeepSpeed config .*missing.json does not exist$"):
        section.engine_stage(on_cuda=True, processes=1)

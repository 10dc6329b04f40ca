"""The config system: defaults, inheritance, overrides, and one-line errors that name the key."""

from pathlib import Path

import pytest

from stages.common.config import SPAConfig, load_config, to_yaml
from stages.common.errors import UserError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_base_yaml_spells_out_the_defaults():
    assert load_config(CONFIGS / "base.yaml") == SPAConfig()


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

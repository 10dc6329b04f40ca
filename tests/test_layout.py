"""The architecture as a test: which package may import which (README, "Project layout").

* `envs` is pure Python: it imports neither torch nor `stages` nor `spa_cli`;
* `stages` never imports `spa_cli`;
* inside `stages`, imports flow down: the entry modules (one per stage) import the shared
  sub-packages, a sub-package imports only those below it (common <- agent <- training <-
  evaluation), and an entry module imports no other entry module but `pipeline`, which chains them,
  and `plan`, which plans the pipeline's stages.

Every import statement counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Sub-packages of stages/, lowest first: each may import itself and those before it.
LAYERS = ("common", "agent", "training", "evaluation")
ENTRIES = ("generate", "clean", "sft", "ppo", "evaluate", "probe")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from stages import sft`
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def allowed(importer: str, imported: str) -> bool:
    """May module `importer` (inside stages) import `imported` (inside stages)?"""
    parts, target = importer.split("."), imported.split(".")
    if len(target) < 2:
        return True  # `import stages` alone
    if len(parts) == 2 and parts[1] in (*ENTRIES, "pipeline", "plan"):  # an entry module
        if target[1] in LAYERS:
            return True
        if parts[1] == "plan":
            return target[1] == "pipeline"
        return parts[1] == "pipeline" and target[1] in ENTRIES
    if len(parts) >= 3 and parts[1] in LAYERS:
        return target[1] in LAYERS and LAYERS.index(target[1]) <= LAYERS.index(parts[1])
    return True  # stages/__init__


@pytest.mark.parametrize("path", sources("stages"), ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_import_downwards_only(path):
    me = module_name(path)
    wrong = sorted(name for name in imported_modules(path)
                   if name == "spa_cli" or name.startswith("spa_cli.")
                   or (name.startswith("stages.") and not allowed(me, name)))
    assert wrong == [], f"{me} imports {wrong}"


@pytest.mark.parametrize("path", sources("envs"), ids=lambda p: str(p.relative_to(ROOT)))
def test_envs_is_pure_python(path):
    wrong = sorted(name for name in imported_modules(path) if name.split(".")[0] in ("torch", "stages", "spa_cli"))
    assert wrong == []


def test_the_rule_itself_catches_an_upward_import():
    assert not allowed("stages.common.config", "stages.agent.prompts")
    assert not allowed("stages.agent.proxy", "stages.training.engine")
    assert not allowed("stages.training.checkpoints", "stages.sft")
    assert not allowed("stages.ppo", "stages.evaluate")
    assert allowed("stages.pipeline", "stages.ppo") and allowed("stages.ppo", "stages.evaluation.runner")
    assert allowed("stages.evaluation.runner", "stages.agent.proxy")
    assert allowed("stages.plan", "stages.pipeline") and not allowed("stages.pipeline", "stages.plan")
    assert not allowed("stages.sft", "stages.plan")


def test_the_readme_layout_names_every_sub_package():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Project layout"):]
    for package in LAYERS:
        assert f"{package}/" in layout, package
        assert (ROOT / "stages" / package / "__init__.py").is_file()
    for entry in (*ENTRIES, "pipeline", "plan"):
        assert (ROOT / "stages" / f"{entry}.py").is_file()

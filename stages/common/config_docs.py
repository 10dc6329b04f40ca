"""docs/configuration.md, written from the schema: `spa config docs --out docs/configuration.md`.

Every section of `stages.common.config.SPAConfig` becomes a table of its keys: type, default (as
`configs/base.yaml` writes it), the values it accepts, the value of SPA's paper or released code,
and the field's `help`. Nothing is written by hand, so the page cannot drift from the schema (a
test compares the committed page with this function's output).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Literal

from stages.common.config import SPAConfig, TrainingConfig, bounds_text, yaml_text

COMMAND = "spa config docs --out docs/configuration.md"
FIRST_LINE = f"<!-- Written from stages/common/config.py by `{COMMAND}`; edit the schema, not this page. -->"
INTRO = f"""# Configuration

Every setting of spa, section by section: its type, its default, the values it accepts, the value
of SPA's paper or released code where they fix one, and why you would set it. A YAML file sets them
(`--config FILE`; a file may start from another with `inherit: other.yaml` and change what
differs), `--set section.key=value` overrides one, and `spa config show` prints the result.
`configs/base.yaml` spells out every default. This page is written from the schema
(`stages/common/config.py`) by `{COMMAND}`."""
HEADER = "| key | type | default | accepts | paper | what it is for |\n|---|---|---|---|---|---|"


def reference() -> str:
    """The whole page, as Markdown."""
    config = SPAConfig()
    sections = [f for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]
    top = [f for f in dataclasses.fields(config) if f not in sections]
    parts = [FIRST_LINE, INTRO, "Sections: " + " · ".join(f"[{f.name}](#{f.name})" for f in sections)
             + " · [top level](#top-level)"]
    for section in sections:
        cls = type(getattr(config, section.name))
        text = _paragraph(cls)
        if issubclass(cls, TrainingConfig):
            shared = ", ".join(f"`{f.name}`" for f in dataclasses.fields(TrainingConfig))
            text += f" Its first keys, {shared}, are the training settings `sft` and `ppo` share."
        parts += [f"## {section.name}", text, _table(cls, dataclasses.fields(cls), section.name + ".")]
    parts += ["## top level", "Settings of the whole run.", _table(SPAConfig, top, "")]
    return "\n\n".join(parts) + "\n"


def _paragraph(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def _table(cls: type, fields: typing.Iterable[dataclasses.Field], prefix: str) -> str:
    hints = typing.get_type_hints(cls)
    rows = [HEADER]
    for f in fields:
        hint, meta = hints[f.name], f.metadata
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        cells = [f"`{prefix}{f.name}`", type_text(hint), f"`{yaml_text(default)}`", accepted(hint, meta.get("range", {})),
                 meta.get("paper", ""), meta.get("help", "")]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def type_text(hint: Any) -> str:
    """A type as the page reads it: integer, number, text, true/false, choice, list of ..., ... or null."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "choice"
    if origin in (typing.Union, types.UnionType):
        kinds = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return "mapping"
    return {bool: "true/false", int: "integer", float: "number", str: "text"}.get(hint, "any")


def accepted(hint: Any, bounds: dict[str, float]) -> str:
    """The choices of a choice (or of each item of a list), else the range of a number."""
    choices = [arg for part in _parts(hint) if typing.get_origin(part) is Literal for arg in typing.get_args(part)]
    if choices:
        return " | ".join(f"`{yaml_text(choice)}`" for choice in choices)
    return bounds_text(bounds)


def _parts(hint: Any) -> list[Any]:
    """The types a hint is made of, through unions and lists."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list):
        return [part for arg in typing.get_args(hint) for part in _parts(arg)]
    return [hint]

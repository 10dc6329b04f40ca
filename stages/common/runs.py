"""Is this the same run? One rule for every stage's output (a file or a directory).

Each stage writes, before anything else, a manifest beside its output (`artifacts.manifest_path`)
whose ``settings`` are what decide the result (the stage's config minus what only changes speed or
length, plus input hashes). Then, when the stage starts:

* nothing at the output yet: a fresh run;
* something there and no ``--resume``: refused, "already holds a run; --resume continues it,
  another --out starts fresh";
* ``--resume`` and the recorded settings differ: refused, naming the first setting that differs;
* ``--resume`` and the same settings: the stage continues where the run stopped (every stage can).

``--resume`` on an output that does not exist yet starts fresh, so a command given ``--resume``
from the start can simply be run again after an interruption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.common import artifacts
from stages.common.errors import UserError


def first_difference(saved: Any, now: Any, path: str = "") -> str | None:
    """``"key.sub: old -> new"`` for the first (sorted) key where two settings trees differ, or None."""
    if isinstance(saved, dict) and isinstance(now, dict):
        for key in sorted(set(saved) | set(now), key=str):
            found = first_difference(saved.get(key), now.get(key), f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if saved == now:
        return None
    return f"{path or 'settings'}: {saved!r} -> {now!r}"


#: How a stage's header line says that it continues an earlier run at its output.
RESUMING = " (resuming: what is there is kept)"


def start(out: str | Path, settings: dict[str, Any], resume: bool, what: str,
          holds_run: bool | None = None) -> bool:
    """Check `out` for a run of `settings`; True when an earlier run is to be continued.

    `what` names the stage in messages ("sft", "eval"). `holds_run` says whether `out` already holds
    output of a run (default: it exists and, for a directory, is not empty).
    """
    out = Path(out)
    if holds_run is None:
        holds_run = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if not holds_run:
        return False
    if not resume:
        raise UserError(f"{out} already holds a {what} run; add --resume to continue it, or choose another "
                        "--out to start fresh")
    recorded = recorded_settings(out)
    if recorded is None:
        raise UserError(f"{out} has no readable {artifacts.manifest_path(out).name}, so it cannot be resumed "
                        "safely; choose another --out to start fresh")
    difference = first_difference(recorded, settings)
    if difference is not None:
        raise UserError(f"cannot resume {out}: it was made with other settings ({difference}); restore them "
                        "to continue it, or choose another --out to start fresh")
    return True


def recorded_settings(out: str | Path) -> dict[str, Any] | None:
    """The settings in the manifest of `out`, or None when there is none (or it is unreadable)."""
    path = artifacts.manifest_path(out)
    if not path.is_file():
        return None
    try:
        data = artifacts.read_json(path)
    except UserError:
        return None
    settings = data.get("settings") if isinstance(data, dict) else None
    return settings if isinstance(settings, dict) else None


def record(out: str | Path, stage: str, config: dict[str, Any], settings: dict[str, Any],
           inputs: dict[str, str | Path] | None = None, **extra: Any) -> None:
    """Write the manifest of `out` with the settings a later `start` compares against."""
    artifacts.write_manifest(out, {**artifacts.manifest(stage, config, inputs), "settings": settings, **extra})

"""SPA's released SFT data, read as our SFT rows.

SPA publishes its world-model SFT data as parquet files (reference notes §3, "Output files"):
``wm_train.parquet`` and ``wm_val.parquet``, in the hub datasets ``tyzhu/SPA-{sokoban,frozenlake,
sudoku}-data``, one row per assistant turn with the columns

* ``prompt``: the list of messages before the turn (``{"role", "content"}``: the system prompt, the
  user messages, earlier assistant turns with their ground-truth states), ending with a user message;
* ``response``: the assistant message of the turn (its text; a ``{"role", "content"}`` mapping is
  read too).

Other columns (``data_source``, ``ability``, ...) are ignored. A row becomes one of our SFT rows
(what `spa clean` writes, docs/formats.md): the prompt's messages, earlier assistant turns
with ``"train": false``, then the response as the one trained assistant message; ``id`` is
``<file stem>-<row index>``, and ``source_id`` names the puzzle (a hash of the first user message),
so that `spa clean` can split them without one puzzle on both sides.

`locate` resolves what ``--data`` names: a local ``.parquet`` (with SPA's validation file beside it,
``wm_train`` -> ``wm_val``), or a hub dataset id (``org/name``), downloaded where the network
allows (offline, or unreachable: one line saying so).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from stages.common.errors import UserError

PARQUET_SUFFIX = ".parquet"
COLUMNS = ("prompt", "response")
ROLES = ("system", "user", "assistant", "tool")


def is_parquet(path: str | Path) -> bool:
    return Path(path).suffix == PARQUET_SUFFIX


def is_hub_dataset(name: str) -> bool:
    """Whether `name` reads as a hub dataset id (``org/name``) rather than a local path: it does not
    exist, has exactly one slash, no file suffix and no leading ``.``, ``/`` or ``~``."""
    return (not Path(name).exists() and name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and not Path(name).suffix)


def locate(data: str) -> tuple[Path, Path | None]:
    """The local training file that `data` names and, for SPA's data, its validation file (None
    when there is none). A hub dataset id is downloaded first (its parquet files)."""
    if is_hub_dataset(data):
        return _download(data)
    path = Path(data)
    if is_parquet(path) and "train" in path.name:
        val = path.with_name(path.name.replace("train", "val"))
        return path, val if val.is_file() else None
    return path, None


def _download(repo_id: str) -> tuple[Path, Path | None]:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["*.parquet", "**/*.parquet"]))
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, no access: all one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot get the dataset {repo_id!r} from the Hugging Face hub ({type(err).__name__}"
                        f"{': ' + first if first else ''}); without network access, download its wm_train.parquet "
                        "and pass the file's path") from None
    files = sorted(folder.rglob(f"*{PARQUET_SUFFIX}"))
    train = [f for f in files if "train" in f.name]
    val = [f for f in files if "val" in f.name or "test" in f.name]
    if len(train) != 1 and len(files) != 1:
        names = ", ".join(str(f.relative_to(folder)) for f in files) or "none"
        raise UserError(f"the dataset {repo_id!r} has no single training parquet file (found: {names}); "
                        "pass the file's path instead")
    return (train or files)[0], (val[0] if len(val) == 1 else None)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Our SFT rows from one of SPA's parquet files (see the module docstring)."""
    path = Path(path)
    table = _read_table(path)
    rows = []
    prompts, responses = table.column("prompt").to_pylist(), table.column("response").to_pylist()
    for index, (prompt, response) in enumerate(zip(prompts, responses)):
        where = f"{path} row {index + 1}"
        messages = [_message(m, where, f"prompt message {i}") for i, m in enumerate(_listed(prompt, where))]
        if isinstance(response, dict):
            response = response.get("content")
        if not isinstance(response, str) or not response.strip():
            raise UserError(f"{where}: 'response' must be the assistant message's text, got {type(response).__name__}")
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        rows.append({
            "id": f"{path.stem}-{index}",
            "source_id": hashlib.sha256(first_user.encode()).hexdigest()[:16],
            "messages": [*messages, {"role": "assistant", "content": response, "train": True}],
        })
    if not rows:
        raise UserError(f"{path} has no rows")
    return rows


def _read_table(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet needs pyarrow: pip install pyarrow (make install does)") from None
    try:
        columns = pq.read_schema(path).names
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise UserError(f"cannot read {path} as parquet: {str(err).strip().splitlines()[0]}") from None
    missing = [column for column in COLUMNS if column not in columns]
    if missing:
        raise UserError(f"{path} is not SPA's SFT data: it has no {' or '.join(missing)} column (columns: "
                        f"{', '.join(columns) or 'none'}); SPA's wm_train.parquet has prompt (the messages "
                        "before the turn) and response (the assistant message)")
    return pq.read_table(path, columns=list(COLUMNS))


def _listed(prompt: Any, where: str) -> list[Any]:
    if not isinstance(prompt, list) or not prompt:
        raise UserError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages")
    return prompt


def _message(message: Any, where: str, which: str) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
        raise UserError(f"{where}: {which} must be an object with a string 'content'")
    if message.get("role") not in ROLES:
        raise UserError(f"{where}: {which} has role {message.get('role')!r}; expected one of {', '.join(ROLES)}")
    out = {"role": message["role"], "content": message["content"]}
    return {**out, "train": False} if message["role"] == "assistant" else out

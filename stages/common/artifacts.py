"""Reading and writing the artifacts the stages exchange: JSONL files, JSON reports, manifests.

Writes are atomic: a temp file in the same directory, then `os.replace`, so a stage killed
half-way leaves either the old file or the new one, never half of one. The one exception is the
append-only JSONL of `spa generate`, where each finished episode is appended and flushed so a kill
loses only the episodes in flight; a torn last line is detected and dropped on resume.

JSONL goes through the standard `json` module here, not a JSONL package: what the stages rely on
(atomic rewrites, appends that never leave half a row, a torn last line dropped, errors that name
the file and line, required keys, a U+2028 inside a string read as text, not as a line end) is
this module's, and the json module does the rest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from stages.common.errors import UserError

MANIFEST_NAME = "manifest.json"
#: A failed checkpoint write with less free space than this on its filesystem was a full disk.
FULL_DISK_SLACK = 1 << 20


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[TextIO]:
    """Open a temp file beside `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    ensure_parent(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make artifacts private
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise _naming(err, path) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temp directory beside `path` to fill; on success it becomes `path`, on error
    it is removed. An existing `path` is replaced (`replace_dir`), or, with ``replace=False``, kept
    (another process finished the same directory first) and the new copy dropped."""
    path = Path(path)
    ensure_parent(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp"))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would make artifacts private
        with full_disk_as_oserror(path):  # named as the user gave it, not the hidden copy
            yield tmp
        if path.exists() and not replace:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give the space of the half-written copy back
        raise


def replace_dir(new: Path, target: Path) -> None:
    """Put the complete directory `new` in place of `target` in two renames: `target` to
    ``.NAME.old``, then `new` to `target`. A kill between the two leaves ``.NAME.old`` and no
    `target`; `recover_leftovers` puts the old one back."""
    old = _old_copy(target)
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _old_copy(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _naming(err: OSError, path: Path) -> OSError:
    """`err` with the artifact's path: a failed write() or fsync() (a full disk) names no file."""
    if err.filename is not None:
        return err
    return type(err)(err.errno, err.strerror, str(path))


def ensure_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create directory {path.parent}: {err.strerror}; choose another path") from None
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"cannot write to {path.parent}: permission denied or read-only; choose another path")


@contextlib.contextmanager
def full_disk_as_oserror(directory: str | Path) -> Iterator[None]:
    """torch.save and safetensors report a failed write without an errno: a RuntimeError
    ("unexpected pos ...") or a SafetensorError whose message ends in Rust's "(os error 28)".
    Re-raise such a failure as the OSError it names, else, when the target filesystem is indeed
    full, as OSError(ENOSPC), naming `directory`: the CLI reports an OSError in one line."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        named = re.search(r"\(os error (\d+)\)", str(err))
        if named is not None:
            code = int(named.group(1))
        elif _nearly_full(Path(directory)):
            code = errno.ENOSPC
        else:
            raise
        raise OSError(code, os.strerror(code), str(directory)) from err


def _nearly_full(directory: Path) -> bool:
    while not directory.exists():
        directory = directory.parent
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize < FULL_DISK_SLACK


def check_writable(path: str | Path) -> None:
    """Refuse, before any work, an output path that cannot be written as a regular file or
    directory: an existing device, pipe or socket (a stage would replace /dev/null with its
    output), a path under a file, or a place where no file can be created: no permission, a
    read-only filesystem, or a virtual one such as /proc or /sys, which is found out by creating
    (and removing) an empty hidden file in the nearest existing directory."""
    target = Path(path).absolute()
    if target.exists() and not (target.is_file() or target.is_dir()):
        raise UserError(f"{path} is a device or another special file, not a regular file; choose another path")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if existing != target and not existing.is_dir():
        raise UserError(f"cannot create {path}: {existing} is a file; choose another path")
    directory = existing if existing.is_dir() else existing.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {directory} (permission denied or read-only); choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".spa-probe-", suffix=".tmp")
    except OSError as err:
        raise UserError(f"cannot create files in {directory} ({err.strerror}; a virtual or read-only "
                        "filesystem?); choose another path") from None
    os.close(fd)
    os.unlink(probe)


def remove_leftovers(directory: str | Path) -> None:
    """Clean up what interrupted writes left under `directory`: a directory whose replacement was
    cut between its two renames gets its old copy back (``.NAME.old`` -> ``NAME``), then every
    hidden ``*.tmp`` or ``*.old`` entry (atomic_write's and atomic_dir's) is deleted."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for old in directory.rglob(".*.old"):
        target = old.with_name(old.name[1:].removesuffix(".old"))
        if old.is_dir() and not target.exists():
            os.replace(old, target)
    leftovers = [p for p in directory.rglob(".*") if p.suffix in (".tmp", ".old")]
    for path in sorted(leftovers, key=lambda p: len(p.parts)):  # parents first; their children go with them
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_write(path) as handle:
        json.dump(obj, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    write_jsonl_files({Path(path): rows})


def write_jsonl_files(files: dict[Path, list[dict]]) -> None:
    """Several JSONL files that belong together (a train/validation split): every temp file is
    written and synced before the first one replaces its target, so a failure (a full disk, a
    kill) leaves the old set or the new one, never a mix."""
    with contextlib.ExitStack() as stack:
        for path, rows in files.items():
            handle = stack.enter_context(atomic_write(path))
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path} as JSON: {err}") from None


def read_jsonl(path: str | Path, skip_bad: bool = False, required: tuple[str, ...] = (),
               fix: str = "fix or delete that line") -> tuple[list[dict], int]:
    """All rows of a JSONL file and the number of bad lines skipped.

    A line that is not a JSON object, or lacks a `required` key, stops with its line number and
    `fix` (what the user can do: a caller whose command has a flag to skip such lines names it)
    unless `skip_bad` is set, in which case it is counted and skipped. Blank lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    rows, bad = [], 0
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                problem = _row_problem(line, required)
                if problem is None:
                    rows.append(json.loads(line))
                elif skip_bad:
                    bad += 1
                else:
                    raise UserError(f"{path}:{number}: {problem}; {fix}")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None
    return rows, bad


def _row_problem(line: str, required: tuple[str, ...]) -> str | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg})"
    if not isinstance(row, dict):
        return "not a JSON object"
    missing = [key for key in required if key not in row]
    return f"missing key(s) {', '.join(missing)}" if missing else None


class JsonlAppender:
    """Append rows to a JSONL file, each synced to disk, after dropping a torn last line from a kill.

    A row that cannot be written whole (a full disk, an interrupt) is cut off again, so the file
    only ever holds whole rows. Unbuffered writes: nothing is left pending for close() to retry.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        ensure_parent(self.path)
        _drop_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def append(self, row: dict) -> None:
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            data = memoryview(line)
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except BaseException as err:
            # An interrupt can land after the row is whole (during fsync): keep it then.
            if os.fstat(self._fd).st_size != size + len(line):
                os.ftruncate(self._fd, size)
            if isinstance(err, OSError):
                raise _naming(err, self.path) from None
            raise

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        handle.truncate(data.rfind(b"\n") + 1)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_versions(names: tuple[str, ...] = ("spa", "torch", "transformers", "deepspeed", "vllm")) -> dict:
    versions = {"python": platform.python_version()}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def manifest(stage: str, config: dict, inputs: dict[str, str | Path] | None = None) -> dict:
    """What produced an artifact: stage, config, input hashes, package versions, command line."""
    return {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "config": config,
        "inputs": {name: {"path": str(p), "sha256": file_sha256(p)} for name, p in (inputs or {}).items()},
        "versions": package_versions(),
    }


def manifest_path(artifact: str | Path) -> Path:
    """The manifest of a directory artifact is `DIR/manifest.json`; of a file, `FILE.manifest.json`."""
    target = Path(artifact)
    return target / MANIFEST_NAME if target.is_dir() else target.with_name(target.name + ".manifest.json")


def write_manifest(artifact: str | Path, data: dict) -> Path:
    path = manifest_path(artifact)
    write_json(path, data)
    return path


def sidecar_path(report: str | Path, name: str) -> Path:
    """The JSONL of a report's rows beside it: (`report.json`, "trajectories") -> `report.trajectories.jsonl`."""
    report = Path(report)
    return report.with_name(f"{report.stem}.{name}.jsonl")


def val_path(path: str | Path) -> Path:
    """Where the validation split of a JSONL lives: `sft.jsonl` -> `sft.val.jsonl`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.val{path.suffix}")

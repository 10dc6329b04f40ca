"""Artifact writes: atomic, and with the permissions a plain open() or mkdir would give."""

import os

import pytest

from stages.common import artifacts


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_atomic_write_replaces_the_file_with_umask_permissions(tmp_path, umask_027):
    path = tmp_path / "report.json"
    path.write_text("old")
    with artifacts.atomic_write(path) as handle:
        handle.write("new")
    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o640  # 0o666 & ~0o027, not mkstemp's 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_atomic_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), artifacts.atomic_write(path) as handle:
        handle.write("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_atomic_dir_fills_a_temp_beside_then_replaces_with_mkdir_permissions(tmp_path, umask_027):
    target = tmp_path / "final"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with artifacts.atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".final-") and tmp.name.endswith(".tmp")
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # the old copy stays until the new one is whole
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert target.stat().st_mode & 0o777 == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_failed_atomic_dir_leaves_the_old_one(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    with pytest.raises(RuntimeError), artifacts.atomic_dir(target) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("killed")
    assert [p.name for p in target.iterdir()] == [] and [p.name for p in tmp_path.iterdir()] == ["final"]


def test_atomic_dir_without_replace_keeps_what_another_process_finished(tmp_path):
    target = tmp_path / "model"
    with artifacts.atomic_dir(target, replace=False) as tmp:
        (tmp / "mine.txt").write_text("mine")
        target.mkdir()
        (target / "theirs.txt").write_text("theirs")  # another converter finished first
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_replacement_killed_between_its_renames_gets_the_old_copy_back(tmp_path):
    run = tmp_path / "run"
    (run / ".trainer_state.old").mkdir(parents=True)  # the old state, renamed aside
    (run / ".trainer_state.old" / "progress.json").write_text('{"step": 3}')
    (run / ".trainer_state-x1.tmp").mkdir()  # the new one, whole or not, never renamed in
    (run / ".metrics.jsonl.abc.tmp").write_text("half")
    artifacts.remove_leftovers(run)
    assert sorted(p.name for p in run.iterdir()) == ["trainer_state"]
    assert (run / "trainer_state" / "progress.json").read_text() == '{"step": 3}'


def _interrupt(*_args):
    raise KeyboardInterrupt


def test_appender_cuts_a_row_interrupted_mid_write(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    real_write = os.write
    with artifacts.JsonlAppender(path) as appender:
        appender.append({"id": 1})
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:3]) and _interrupt())
        with pytest.raises(KeyboardInterrupt):
            appender.append({"id": 2})
    assert path.read_text() == '{"id": 1}\n'


def test_appender_keeps_a_whole_row_interrupted_during_fsync(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    with artifacts.JsonlAppender(path) as appender:
        monkeypatch.setattr(os, "fsync", _interrupt)
        with pytest.raises(KeyboardInterrupt):
            appender.append({"id": 1})
    assert path.read_text() == '{"id": 1}\n'


def test_jsonl_rows_keep_unicode_line_separators_and_a_torn_tail_goes(tmp_path):
    # ensure_ascii=False writes U+2028, U+2029, U+0085 and form feeds unescaped: inside a string
    # they are text (str.splitlines would cut the row at each of them)
    rows = [{"id": 1, "text": "one\u2028two\u2029three\x85four\x0cfive"}, {"id": 2, "text": "\u2028"}]
    path = tmp_path / "t.jsonl"
    artifacts.write_jsonl(path, rows)
    assert artifacts.read_jsonl(path) == (rows, 0)
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"id": 3, "te')  # a kill mid-row
    assert artifacts.read_jsonl(path, skip_bad=True) == (rows, 1)
    with artifacts.JsonlAppender(path) as appender:  # drops the torn row before appending
        appender.append({"id": 3})
    assert artifacts.read_jsonl(path) == ([*rows, {"id": 3}], 0)

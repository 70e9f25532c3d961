"""Crash-safe checkpoints and history."""

import signal
import subprocess
import sys
import textwrap

import pytest

from art.errors import ArtValueError
from art.storage import CheckpointStore, append_history, read_history
from art.storage.layout import ModelDir


def test_checkpoint_appears_only_when_complete(tmp_path):
    store = CheckpointStore(tmp_path)

    def fill(folder):
        (folder / "a.bin").write_bytes(b"x" * 10)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        store.write(1, fill)
    assert store.steps() == [] and list(tmp_path.iterdir()) == []
    store.write(1, lambda folder: (folder / "a.bin").write_bytes(b"ok"))
    assert store.steps() == [1] and (tmp_path / "0001" / "a.bin").read_bytes() == b"ok"
    with pytest.raises(FileExistsError):
        store.write(1, lambda folder: None)


@pytest.mark.integration
def test_process_killed_mid_write_leaves_no_half_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import os, time
        from art.storage import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r})
        store.write(0, lambda f: (f / "w").write_bytes(b"zero"))
        def slow(folder):
            (folder / "w").write_bytes(b"half")
            print("writing", flush=True)
            time.sleep(60)
        store.write(1, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # the crash left its temp dir
    store = CheckpointStore(tmp_path)  # reopening cleans it up
    assert store.steps() == [0] and store.latest_step() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000"]


def test_history_skips_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "history.jsonl"
    append_history(path, {"step": 0, "train/reward": 0.5})
    with open(path, "a") as f:
        f.write('{"step": 1, "train/rew')
    assert read_history(path) == [{"step": 0, "train/reward": 0.5}]


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden", "x" * 200, "a\\b"])
def test_names_that_would_escape_the_run_folder_are_refused(tmp_path, bad):
    with pytest.raises(ArtValueError):
        ModelDir(tmp_path, bad, "model")
    with pytest.raises(ArtValueError):
        ModelDir(tmp_path, "project", bad)
    assert list(tmp_path.iterdir()) == []

"""Progress bars written where no terminal reads them (a CI log, `| tee`): one plain line per
update, no carriage-return fragments (issue 45); on a terminal, tqdm's bar as before."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from art.observability.progress import LineProgress, progress_bar

SCRIPT = '''
import asyncio
from types import SimpleNamespace

import art
from art.gather import gather_trajectory_groups
from art.utils import iterate_dataset


async def rollout(reward):
    await asyncio.sleep(0.01)
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}], reward=reward)


class Model:
    name, project = "m", "p"
    def __init__(self): self.step, self.state = 0, {}
    async def get_step(self): return self.step
    def read_state(self): return self.state
    def merge_state(self, state): self.state.update(state)
    async def log(self, *args, **kwargs): pass


class Backend:
    async def train(self, model, groups, **kwargs):
        await asyncio.sleep(0.01)
        model.step += 1
        return SimpleNamespace(step=model.step, metrics={"loss": 0.1})
    async def log(self, *args, **kwargs): pass
    async def list_checkpoints(self, model): return []
    async def delete_checkpoints(self, *args, **kwargs): pass
    async def get_history(self, model): return []


async def group_rollout(model, scenario, config):
    return art.TrajectoryGroup([await rollout(0.0), await rollout(1.0)])


async def main():
    await gather_trajectory_groups([art.TrajectoryGroup(rollout(float(i % 2)) for i in range(2)) for _ in range(3)],
                                   pbar_desc="gather")
    for _ in iterate_dataset(list(range(4)), groups_per_step=1, num_epochs=1):
        pass
    trainer = art.PipelineTrainer(Model(), Backend(), group_rollout, range(40), None,
                                  pipeline=art.PipelineRuntimeConfig(num_rollout_workers=2, min_batch_size=1,
                                                                     max_batch_size=1), max_steps=3)
    await trainer.train(handle_signals=False)


asyncio.run(main())
'''
"""A gather of 6 trajectories, an iteration over 4 batches and a 3-step pipeline on fakes."""


def run_script(**kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], timeout=120, **kwargs)


def test_piped_output_has_one_plain_line_per_update_and_no_carriage_returns():
    done = run_script(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # as `2>&1 | tee log`
    out = done.stdout.decode()
    assert done.returncode == 0, out
    assert "\r" not in out and "\x1b" not in out, repr(out[:500])
    lines = out.splitlines()
    gather = [line for line in lines if line.startswith("gather: ")]
    assert [re.match(r"gather: (\d+)/6 traj \[", line).group(1) for line in gather] == ["1", "2", "3", "4", "5", "6"]
    assert "reward=0.5" in gather[-1]
    dataset = [line for line in lines if line.startswith("Iterating dataset: ")]
    assert [line.split()[2] for line in dataset] == ["1/4", "2/4", "3/4", "4/4"]
    steps = [line for line in lines if line.startswith("pipeline: ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"], steps
    assert all("reward=0.5" in line for line in steps)  # each step's line carries that step's postfix
    assert len(lines) == len(gather) + len(dataset) + len(steps), lines


def test_on_a_terminal_the_bars_are_tqdms():
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 wide
    try:
        done = run_script(stdout=child, stderr=child)
        os.close(child)
        child = None
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child's end is closed: all is read
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        if child is not None:
            os.close(child)
    assert done.returncode == 0, out
    assert b"\r" in out and b"6/6" in out and b"3/3" in out


def test_a_line_bar_writes_only_lines_and_tqdm_write_beside_it_stays_whole():
    from tqdm.auto import tqdm

    stream = io.StringIO()
    bar = progress_bar(total=2, desc="train step 0", unit="batch", leave=False, file=stream)
    assert isinstance(bar, LineProgress)
    bar.refresh()  # a redraw without progress writes nothing
    bar.update(1)
    tqdm.write("[art] a note", file=stream)
    bar.set_postfix({"loss": 0.25}, refresh=True)  # a new postfix alone waits for the next line
    bar.update(1)
    bar.close()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split(" [")[0] for line in lines] == ["train step 0: 1/2 batch", "[art] a note",
                                                      "train step 0: 2/2 batch"]
    assert "loss=0.25" in lines[-1]
    quiet = progress_bar(total=3, desc="x", disable=True, file=stream)
    quiet.update(3)
    quiet.close()
    assert stream.getvalue().splitlines() == lines

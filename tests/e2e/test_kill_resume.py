"""kill -9 in the middle of a training run, then the same script again: it resumes."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import art

    async def rollout(model, seed):
        messages = [{"role": "user", "content": "Pick."}]
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=messages, max_tokens=3, seed=seed)
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(choice.token_ids[0] % 2))

    async def main(path, base_model, steps):
        model = art.TrainableModel(name="m", project="p", base_model=base_model)
        await model.register(art.LocalBackend(path=path))
        print("start", await model.get_step(), flush=True)
        for step in range(await model.get_step(), steps):
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, 10 * step + i) for i in range(4))], pbar_desc=None)
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            print("done", step + 1, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def test_kill_during_training_then_rerun_resumes(tiny_model_path, tmp_path):
    args = [sys.executable, "-c", SCRIPT, str(tmp_path), str(tiny_model_path)]
    proc = subprocess.Popen(args + ["50"], stdout=subprocess.PIPE, text=True)
    lines = []
    while not lines or lines[-1] != "done 2":  # kill while step 3 is in progress
        lines.append(proc.stdout.readline().strip())
        assert lines[-1], f"script ended early: {lines}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert steps[:3] == [0, 1, 2] and len(steps) <= 4  # step 3 may have landed whole, never half
    for step in steps:
        assert (checkpoints / f"{step:04d}" / "optimizer.pt").exists()

    rerun = subprocess.run(args + [str(steps[-1] + 1)], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    out = rerun.stdout.split()
    assert out[:2] == ["start", str(steps[-1])] and out[-2:] == ["done", str(steps[-1] + 1)]
    rows = [json.loads(line) for line in (tmp_path / "p" / "models" / "m" / "history.jsonl").open()]
    assert rows[-1]["step"] == steps[-1]

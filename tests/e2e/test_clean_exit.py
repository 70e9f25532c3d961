"""A user script that fails, or is interrupted, while the LocalBackend works ends as any Python
script does: its traceback and exit status 1 (Ctrl-C: KeyboardInterrupt), never an abort
(`terminate called without an active exception`, SIGABRT, 134) from an engine thread still
inside a torch op when the interpreter shuts down."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import openai
    import art

    MESSAGES = [{"role": "user", "content": "Tell me a long story."}]

    async def main(path, base_model, how):
        model = art.TrainableModel(name="m", project="p", base_model=base_model)
        backend = art.LocalBackend(path=path)
        await model.register(backend)
        loaded = backend.service.loaded(("p", "m"))
        client = model.openai_client()

        async def story():
            return await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=400,
                                                        extra_body={"ignore_eos": True})

        if how == "raise":
            requests = [asyncio.create_task(story()) for _ in range(16)]
            while not loaded.engine.rows:  # decoding: the engine thread is inside torch ops
                await asyncio.sleep(0.01)
            raise RuntimeError("the user's script failed")

        if how == "gather":  # ART's dev/yes_no_maybe.py on a slow machine: clients time out
            impatient = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key,
                                           max_retries=0)

            async def rollout():
                completion = await impatient.chat.completions.create(
                    model=model.name, messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True},
                    timeout=0.2)
                return art.Trajectory(messages_and_choices=[*MESSAGES, completion.choices[0]], reward=0.0)

            await art.gather_trajectory_groups([art.TrajectoryGroup(rollout() for _ in range(8))], pbar_desc=None)
            sys.exit("unreachable: every rollout should have timed out")

        # "step": Ctrl-C arrives while a long training step runs and requests decode beside it.
        completion = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=8, n=4)
        groups = [art.TrajectoryGroup(art.Trajectory(messages_and_choices=[*MESSAGES, choice], reward=float(i))
                                      for i, choice in enumerate(completion.choices)) for _ in range(8)]
        training = asyncio.create_task(model.train(groups, _config={"epochs": 100, "mini_batches": 4}))
        requests = [asyncio.create_task(story()) for _ in range(8)]
        while loaded.training_since is None and not training.done():
            await asyncio.sleep(0.01)
        print("mid-step", flush=True)
        await training
        sys.exit("unreachable: the step is far longer than the test waits")

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
""")


def _run(tmp_path, tiny_model_path, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), str(tiny_model_path), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _checkpoints(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "p" / "models" / "m" / "checkpoints").iterdir())


@pytest.mark.parametrize("how, error", [
    ("raise", "RuntimeError: the user's script failed"),
    ("gather", "art.errors.TooManyExceptionsError"),
])
def test_script_that_raises_while_the_engine_decodes_exits_1_with_its_traceback(tiny_model_path, tmp_path, how,
                                                                                   error):
    process = _run(tmp_path, tiny_model_path, how)
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert "terminate called" not in stderr, stderr[-3000:]
    assert process.returncode == 1, (process.returncode, stderr[-3000:])
    assert "Traceback (most recent call last)" in stderr and error in stderr, stderr[-3000:]
    assert "Exception in thread" not in stderr, stderr[-3000:]  # every thread stopped cleanly


def test_ctrl_c_mid_step_exits_with_keyboard_interrupt_and_rolls_the_step_back(tiny_model_path, tmp_path):
    process = _run(tmp_path, tiny_model_path, "step")
    try:
        for line in process.stdout:  # the backend prints the training config first
            if line.strip() == "mid-step":
                break
        else:
            pytest.fail(process.communicate()[1][-3000:])
        time.sleep(1.0)  # a few micro-batches in
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        took = time.monotonic() - interrupted
    finally:
        process.kill()
    assert "terminate called" not in stderr, stderr[-3000:]
    # Python's own ending for Ctrl-C: the KeyboardInterrupt traceback, then death by SIGINT (130 in a shell).
    assert process.returncode in (-signal.SIGINT, 130, 1), (process.returncode, stderr[-3000:])
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert "Exception in thread" not in stderr, stderr[-3000:]
    assert took < 30, f"the step ran on for {took:.0f} s after Ctrl-C"  # it stops at its next micro-batch
    assert _checkpoints(tmp_path) == ["0000"]  # rolled back: the model stays at step 0

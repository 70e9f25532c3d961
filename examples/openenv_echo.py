"""Train on an OpenEnv environment: its client drives each rollout, its reward trains the policy.

OpenEnv (meta-pytorch's standard for agentic environments) serves an environment over HTTP and
WebSocket; a rollout talks to it only through the environment's client (`reset`, `step`), so
any OpenEnv environment plugs into ART's loop unchanged, as in ART's OpenEnv docs. Here the
environment is an echo environment like OpenEnv's `echo_env` (reward: 0.1 per character of the
message sent), defined below with OpenEnv's own server helpers and served in this process on
loopback: no container. `--env-url` points the clients at a running OpenEnv echo server instead.
The task is ART's docs': "Use at most 100 tokens; maximize the total character length of the
output", so a group's episodes differ by how long and how wordy they run.

Needs `openenv-core`; its import pulls fastmcp, not gradio, so this is enough:
  pip install --no-deps openenv-core==0.3.0 fastmcp-slim==4.1.1 py-key-value-aio==0.4.6 beartype==0.23.1 \
      pydantic-settings==2.16.3 python-dotenv==1.2.4 email-validator==2.4.0 dnspython==2.9.2 exceptiongroup==1.3.2

Measured on the 2-core CPU, shared with other jobs (default model, seed 0, defaults: 2 groups of 6,
100 tokens, lr 1e-3), mean reward by step 0-5: 36.5 34.2 45.1 44.4 45.6 47.9 (365 -> 479 characters;
from step 2 nearly every reply runs to the 100-token limit); ~32 s a step. Every sampled token
trained as the sampler's own id: 6,990 of 6,990.
Run:  python examples/openenv_echo.py [--steps 8] [--seed 0] [--env-url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import Action, Observation, State

import art
from art.server.thread import ServerThread

PROMPT = "Use at most 100 tokens; maximize the total character length of the output."
REWARD_PER_CHAR = 0.1


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class EchoEnvironment(Environment):
    """The server side: echoes each message back, rewarding its length (OpenEnv's echo_env)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", reward=0.0)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        length = len(action.message)
        return EchoObservation(echoed_message=action.message, message_length=length,
                               reward=length * REWARD_PER_CHAR, done=True)

    @property
    def state(self) -> State:
        return self._state


class EchoEnv(EnvClient[EchoAction, EchoObservation, State]):
    """The client side: what a rollout holds (one WebSocket session per client)."""

    def _step_payload(self, action: EchoAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[EchoObservation]:
        observation = payload.get("observation", {})
        return StepResult(observation=EchoObservation(
            echoed_message=observation.get("echoed_message", ""), message_length=observation.get("message_length", 0),
            done=payload.get("done", False), reward=payload.get("reward")),
            reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


class _ClosedSocketNoise(logging.Filter):
    """openenv-core 0.3.0 closes a WebSocket the client already closed; this Starlette raises
    WebSocketDisconnect there (it expects RuntimeError) and uvicorn logs it. Harmless: dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and type(record.exc_info[1]).__name__ == "WebSocketDisconnect")


@contextlib.contextmanager
def serve_echo_env(max_sessions: int = 64) -> Iterator[str]:
    """The echo environment's OpenEnv server on a free loopback port; yields its base URL."""
    app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=max_sessions)
    noise = _ClosedSocketNoise()
    logging.getLogger("uvicorn.error").addFilter(noise)
    try:
        with ServerThread(app) as server:
            yield server.base_url
    finally:
        logging.getLogger("uvicorn.error").removeFilter(noise)


async def rollout(model: art.Model, env: EchoEnv, max_tokens: int = 100, seed: int | None = None) -> art.Trajectory:
    """One episode: reset the environment, let the model act once, step the environment with
    the reply; the environment's reward is the trajectory's."""
    await env.reset()
    trajectory = art.Trajectory(messages_and_choices=[{"role": "system", "content": PROMPT}], reward=0.0)
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=max_tokens, seed=seed)
    choice = completion.choices[0]
    result = await env.step(EchoAction(message=(choice.message.content or "").strip()))
    trajectory.messages_and_choices.append(choice)
    trajectory.reward = float(result.reward or 0.0)
    trajectory.metrics = {"chars": float(result.observation.message_length),
                          "completion_tokens": float(completion.usage.completion_tokens if completion.usage else 0),
                          "hit_token_limit": float(choice.finish_reason == "length")}
    return trajectory.finish()


async def train(backend: art.LocalBackend, model: art.TrainableModel, env_url: str, steps: int, seed: int = 0,
                groups_per_step: int = 2, group_size: int = 6, max_tokens: int = 100,
                learning_rate: float = 1e-3) -> list[dict]:
    """The loop: one environment client per concurrent rollout; one row per step, measured on
    that step's episodes before its update (reward, chars, and the share of the tokens the
    sampler produced that trained as its own ids)."""
    clients = [EchoEnv(base_url=env_url) for _ in range(groups_per_step * group_size)]
    rows, start = [], time.monotonic()
    try:
        for client in clients:
            await client.connect()
        for step in range(await model.get_step(), steps):
            rng = random.Random(seed * 10_000 + step)
            pool = iter(clients)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, next(pool), max_tokens, seed=rng.randrange(2**31))
                                     for _ in range(group_size)) for _ in range(groups_per_step)),
                pbar_desc=None)
            trajectories = [t for g in groups for t in g.trajectories]
            produced = sum(t.metrics["completion_tokens"] for t in trajectories)
            result = await backend.train(model, groups, learning_rate=learning_rate)
            await model.log(groups, metrics=result.metrics, step=result.step, split="train")
            row = {"step": step, "reward": sum(t.reward for t in trajectories) / len(trajectories),
                   "chars": sum(t.metrics["chars"] for t in trajectories) / len(trajectories),
                   "trained_tokens": result.metrics.get("trained_tokens", 0.0), "produced_tokens": produced,
                   "seconds": time.monotonic() - start}
            row["exact_id_share"] = row["trained_tokens"] / produced if produced else 0.0
            rows.append(row)
            print(f"step {step}: mean reward {row['reward']:.2f} ({row['chars']:.0f} chars), trained "
                  f"{row['trained_tokens']:.0f} of {produced:.0f} sampled tokens ({row['seconds']:.0f} s)", flush=True)
    finally:
        for client in clients:
            await client.close()
    return rows


async def main(steps: int = 8, seed: int = 0, path: str = ".art", env_url: str | None = None,
               base_model: str = art.DEFAULT_MODEL, **options: Any) -> list[dict]:
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"openenv-echo-seed{seed}", project="openenv", base_model=base_model)
    await model.register(backend)
    try:
        if env_url:
            return await train(backend, model, env_url, steps, seed, **options)
        with serve_echo_env() as url:
            return await train(backend, model, url, steps, seed, **options)
    finally:
        await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    parser.add_argument("--env-url", default=None, help="a running OpenEnv echo server; default: one served here")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed, args.path, args.env_url, groups_per_step=args.groups_per_step,
                     group_size=args.group_size, max_tokens=args.max_tokens, learning_rate=args.learning_rate))

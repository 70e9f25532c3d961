"""The public surface: __all__ complete, ART's import paths, and the seed guide's code as written."""

import types

import pytest

import art


def test_all_lists_every_public_name():
    public = {name for name in vars(art) if not name.startswith("_") and not isinstance(getattr(art, name), types.ModuleType)}
    public |= {"dev", "utils"}
    assert set(art.__all__) == public
    from art.local import LocalBackend

    assert LocalBackend is art.LocalBackend
    from art.utils import iterate_dataset  # noqa: F401


@pytest.mark.integration
async def test_seed_guide_snippets_run_as_written(tiny_model_path, tmp_path, monkeypatch):
    """The seed's three snippets, with only the backend path and model name changed, and the
    real `weave` package (the `tracing` extra): `@weave.op` works without `weave.init`."""
    monkeypatch.chdir(tmp_path)

    class Scenario:
        def __init__(self, prompt):
            self.prompt = prompt

    scenarios = [Scenario("Say yes."), Scenario("Say no.")]

    def score(content, scenario):
        return float(len(content) % 3)

    NUM_STEPS, GROUP_SIZE = 1, 3

    # --- snippet 1: defining a model (base_model changed) ---
    model = art.TrainableModel(
        name="agent-001",
        project="my-agent",
        base_model=str(tiny_model_path),
    )
    backend = art.LocalBackend()          # or a remote backend
    await model.register(backend)

    # --- snippet 2: a rollout ---
    import weave

    @weave.op
    async def rollout(model: art.Model, scenario) -> art.Trajectory:
        client = model.openai_client()
        traj = art.Trajectory(messages_and_choices=[], reward=0.0)

        messages = [{"role": "user", "content": scenario.prompt}]
        completion = await client.chat.completions.create(
            model=model.name, messages=messages,
        )
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)

        traj.reward = score(choice.message.content, scenario)  # your reward fn
        return traj

    # --- snippet 3: the training loop ---
    for step in range(NUM_STEPS):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s) for _ in range(GROUP_SIZE))
             for s in scenarios)
        )
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))

    assert await model.get_step() == 1
    assert (tmp_path / ".art" / "my-agent" / "models" / "agent-001" / "checkpoints" / "0001").is_dir()
    await backend.close()

"""The main job on the real default model: the mean reward must clearly rise (minutes, CPU)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "yes_no_maybe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("yes_no_maybe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_function_orders_the_answers():
    example = load_example()
    assert example.score("Maybe.") == 1.0
    assert example.score("No") == 0.75
    assert example.score("yes!") == 0.5
    assert example.score("I think the answer is maybe") == 0.5  # maybe, halved: > 3 words
    assert example.score("Sure thing") == 0.0
    assert len(set(example.make_prompts())) == len(example.make_prompts()) == 24


@pytest.mark.integration
@pytest.mark.slow
async def test_default_model_reward_rises(tmp_path):
    example = load_example()
    rewards = await example.main(steps=8, seed=0, group_size=8, prompts_per_step=4,
                                 learning_rate=1e-3, path=str(tmp_path))
    assert len(rewards) == 8
    last3 = sum(rewards[-3:]) / 3
    assert last3 > rewards[0] + 0.2, f"reward did not rise: {rewards}"
    assert (tmp_path / "yes-no-maybe" / "models" / "maybe-seed0" / "reward.png").stat().st_size > 1000

"""Fake data and small rollouts that several test modules share: choices with fixed token ids,
sequences and trajectory groups with fixed advantages, greedy probes of a served model, and a
seeded LoRA. Nothing here is collected as a test."""

import random
from types import SimpleNamespace

import torch
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

import art
from art.training.batch import plan_micro_batches
from art.training.loss import Normalizer
from art.training.sequences import Sequence
from art.training.trainer import Trainer


def make_choice(prompt_ids, completion_ids, logprobs=None, with_logprobs=True):
    logprobs = logprobs or [-0.5] * len(completion_ids)
    content = [ChatCompletionTokenLogprob(token=str(t), logprob=lp, bytes=None, top_logprobs=[])
               for t, lp in zip(completion_ids, logprobs)]
    return Choice(
        index=0, finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content="x"),
        logprobs=ChoiceLogprobs(content=content) if with_logprobs else None,
        prompt_token_ids=list(prompt_ids), token_ids=list(completion_ids),
    )


async def greedy_logprobs(model: art.TrainableModel, name: str) -> list[float]:
    completion = await model.openai_client().chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Say something."}], max_tokens=6, temperature=0
    )
    return [entry.logprob for entry in completion.choices[0].logprobs.content]


async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    messages = [{"role": "user", "content": "Pick a token."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed
    )
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(choice.token_ids[0] % 2))


async def one_step(model, step):
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=100 * step + i) for i in range(4)) for _ in range(2)],
        pbar_desc=None,
    )
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


def groups_of_choices(seed=0, groups=2, samples=4):
    """TrajectoryGroups of fixed token ids; the reward favours even first tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(5, 900) for _ in range(6)]
        trajectories = []
        for i in range(samples):
            completion = [rng.randrange(5, 900) for _ in range(3 + i)]
            logprobs = [rng.uniform(-7.0, -6.0) for _ in completion]
            trajectories.append(art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "x"}, make_choice(prompt, completion, logprobs)],
                reward=float(completion[0] % 2 == 0) + 0.1 * i))
        out.append(art.TrajectoryGroup(trajectories))
    return out


def make_groups(seed=0, groups=3, samples=4, turns=1):
    """Groups whose samples share a prompt; multi-turn samples continue with a tool result and
    a second completion. Advantages and sampler logprobs are arbitrary but fixed."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(5, 900) for _ in range(rng.randrange(4, 12))]
        group = []
        for i in range(samples):
            s = Sequence(group=g, advantage=rng.uniform(-1.5, 1.5))
            s.extend(prompt, None)
            for turn in range(turns):
                if turn:
                    s.extend([rng.randrange(5, 900) for _ in range(3)], None)  # a tool result
                first = [prompt[0]] if i % 2 else []  # some samples start alike
                completion = first + [rng.randrange(5, 900) for _ in range(rng.randrange(1, 9))]
                s.extend(completion, [rng.uniform(-4.0, -0.1) for _ in completion])
            group.append(s)
        out += group
    return out


def trainer_loss_and_grads(model, sequences, options):
    trainer = Trainer(model, SimpleNamespace(pad_token_id=0))
    normalizer = Normalizer(options.loss_normalization, sum(s.num_trained for s in sequences), len(sequences),
                            options.max_tokens_normalizer)
    model.zero_grad()
    total = 0.0
    micro = plan_micro_batches(sequences, options)
    for batch in micro:
        terms = trainer._forward(batch, options, normalizer)
        terms["loss"].backward()
        total += float(terms["loss"].detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return total, grads, micro


def randomize_lora(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name and ".default." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)

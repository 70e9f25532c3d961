"""One GRPO update of the live LoRA adapter from trajectory groups.

The spine: groups -> advantages -> token sequences -> micro-batches -> loss -> one AdamW step.
It shares the model with the engine (CPU): it holds the model lock while it runs. It knows
nothing about HTTP or storage layout; `save`/`restore` write and read one checkpoint folder.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from art.training.advantages import balance_advantage, group_advantages, reward_std
from art.training.logprobs import sequence_logprobs
from art.training.loss import Normalizer, policy_loss_terms
from art.training.options import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, TrainOptions
from art.training import sequences
from art.training.sequences import Sequence, sequences_of_trajectory

log = logging.getLogger(__name__)

EQUAL_REWARDS = "group_rewards_all_equal"
OPTIMIZER_FILE = "optimizer.pt"


class Trainer:
    def __init__(self, model, tokenizer, *, lock: threading.RLock | None = None) -> None:
        self.model = model  # a PeftModel whose live adapter is trainable
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.lock = lock or threading.RLock()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=5e-6, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY
        )

    # -- the update -----------------------------------------------------------------------
    def step(self, groups, options: TrainOptions, *, desc: str = "train") -> dict[str, float]:
        """Apply one update; returns metrics (with `skipped/<reason>` counts and, when nothing
        could be trained, `nothing_to_train` = 1 and a warning that says why)."""
        sequences, issues, stats = prepare_batch(groups, options)
        metrics: dict[str, float] = {f"skipped/{k}": float(v) for k, v in sorted(issues.items())}
        metrics.update(stats)
        if issues:
            log.warning("training input not used as given: %s", describe(issues))
        if not sequences:
            metrics["nothing_to_train"] = 1.0
            log.warning("nothing to train in this step (%s); the step advances with unchanged weights",
                        describe(issues) or "no groups given")
            return metrics
        total_trained = sum(s.num_trained for s in sequences)
        normalizer = Normalizer(options.loss_normalization, total_trained, len(sequences),
                                options.max_tokens_normalizer)
        for group in self.optimizer.param_groups:
            group["lr"] = options.learning_rate
        sums: Counter = Counter()
        with self.lock:
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            batches = micro_batches(sequences, options.micro_batch_tokens)
            before = self._pre_update_logprobs(batches) if options.precalculate_logprobs else None
            for i, batch in enumerate(tqdm(batches, desc=desc, unit="batch", leave=False)):
                terms = self._forward(batch, options, normalizer, None if before is None else before[i])
                terms["loss"].backward()  # this micro-batch's share of the batch loss
                sums.update({k: float(v.detach()) for k, v in terms.items()})
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, options.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
        computed = sum(len(b) * max(len(s.token_ids) for s in b) for b in batches)
        metrics.update({
            "loss": sums["loss"],
            "policy_loss": sums["policy_loss"] / total_trained,
            "clip_fraction": sums["clipped_tokens"] / total_trained,
            "ratio_mean": sums["ratio"] / total_trained,
            "grad_norm": float(grad_norm),
            "learning_rate": options.learning_rate,
            "trained_tokens": float(total_trained),
            "tokens_in_batch": float(sum(len(s.token_ids) for s in sequences)),
            "tokens_computed": float(computed),
            "sequences": float(len(sequences)),
        })
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / total_trained
        if "tis_weight" in sums:  # truncated importance sampling: mean weight, share capped
            metrics["tis_weight_mean"] = sums["tis_weight"] / total_trained
            metrics["tis_truncated_fraction"] = sums["tis_truncated"] / total_trained
        return metrics

    def _inputs(self, batch: list[Sequence]) -> dict[str, torch.Tensor]:
        width = max(len(s.token_ids) for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [rows, tokens]
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width))
        old = torch.zeros((len(batch), width))
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            attention[i, :n] = 1
            mask[i, :n] = torch.tensor(s.trained, dtype=torch.float)
            old[i, :n] = torch.tensor(s.sampler_logprobs).nan_to_num(0.0)
        return {"ids": ids, "attention": attention, "mask": mask, "sampler": old}

    def _logprobs(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_logprobs(self.model, inputs["ids"], inputs["attention"])  # [rows, tokens-1]

    @torch.no_grad()
    def _pre_update_logprobs(self, batches: list[list[Sequence]]) -> list[torch.Tensor]:
        """The current policy's logprobs of every micro-batch, before any gradient (TIS)."""
        return [self._logprobs(self._inputs(batch)) for batch in batches]

    def _forward(self, batch: list[Sequence], options: TrainOptions, normalizer: Normalizer,
                 before: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        inputs = self._inputs(batch)
        advantages = torch.tensor([s.advantage for s in batch])  # [rows]
        new = self._logprobs(inputs)  # [rows, tokens-1]
        ref = None
        if options.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._logprobs(inputs)
        sampler = inputs["sampler"][:, 1:]
        epsilon, epsilon_high = options.clip_range()
        return policy_loss_terms(
            new, sampler if before is None else before, advantages, inputs["mask"][:, 1:],
            epsilon=epsilon, epsilon_high=epsilon_high, beta=options.beta, ref_logprobs=ref,
            ppo=options.ppo, importance_sampling_level=options.importance_sampling_level,
            sampler_logprobs=None if before is None else sampler,
            truncated_importance_sampling=options.truncated_importance_sampling,
            normalizer=normalizer,
        )

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Adapter (peft format, servable by vLLM too) and optimizer state into `folder`."""
        with self.lock:
            self.model.save_pretrained(str(folder), selected_adapters=["default"])
            torch.save(self.optimizer.state_dict(), Path(folder) / OPTIMIZER_FILE)

    def restore(self, folder: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        with self.lock:
            weights = load_file(str(Path(folder) / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(self.model, weights, adapter_name="default")
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
            if missing:
                raise RuntimeError(f"checkpoint {folder} does not match the adapter: {missing[:3]}")
            optimizer_file = Path(folder) / OPTIMIZER_FILE
            if optimizer_file.exists():
                self.optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))


def prepare_batch(groups, options: TrainOptions) -> tuple[list[Sequence], Counter, dict[str, float]]:
    """Advantages per group, then sequences; skips (and counts) what carries no signal."""
    issues: Counter = Counter()
    sequences: list[Sequence] = []
    trained_groups = 0
    groups = [list(group.trajectories) for group in groups]
    batch_std = reward_std([float(t.reward) for group in groups for t in group])
    for trajectories in groups:
        rewards = [float(t.reward) for t in trajectories]
        if len(set(rewards)) < 2:
            issues[EQUAL_REWARDS] += 1
            continue
        trained_groups += 1
        advantages = group_advantages(rewards, scale_rewards=options.reward_scaling, batch_std=batch_std)
        for trajectory, advantage in zip(trajectories, advantages):
            advantage = balance_advantage(advantage, options.advantage_balance)
            for sequence in sequences_of_trajectory(trajectory, issues):
                if advantage == 0.0 and options.beta == 0:
                    continue  # contributes no gradient
                sequence.advantage = advantage
                sequences.append(sequence)
    return sequences, issues, {"groups_trained": float(trained_groups)}


def micro_batches(sequences: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """Length-sorted rows, each batch's padded size (rows x longest) within `max_tokens`."""
    ordered = sorted(sequences, key=lambda s: len(s.token_ids))
    batches: list[list[Sequence]] = []
    current: list[Sequence] = []
    for s in ordered:
        if current and (len(current) + 1) * len(s.token_ids) > max_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def describe(issues: Counter) -> str:
    hints = {
        EQUAL_REWARDS: "groups whose rewards are all equal carry no signal",
        sequences.NO_TOKEN_IDS: "choices without prompt_token_ids/token_ids (not from an art backend?)",
        sequences.NO_LOGPROBS: "choices without logprobs matching their token ids",
        sequences.ASSISTANT_DICT: "assistant turns given as dicts are context only; append the Choice to train it",
        sequences.NO_CHOICES: "trajectories with no trainable Choice",
        sequences.SEQUENCE_BREAK: "turns whose prompt ids do not extend the earlier "
        "ids (trained as a new sequence; see art.training.audit)",
    }
    return "; ".join(f"{n} x {hints.get(reason, reason)}" for reason, n in sorted(issues.items()))



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

from art.training.advantages import group_advantages
from art.training.loss import policy_loss_terms, token_logprobs
from art.training.options import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, TrainOptions
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
            log.warning("training input not used: %s", describe(issues))
        if not sequences:
            metrics["nothing_to_train"] = 1.0
            log.warning("nothing to train in this step (%s); the step advances with unchanged weights",
                        describe(issues) or "no groups given")
            return metrics
        total_trained = sum(s.num_trained for s in sequences)
        for group in self.optimizer.param_groups:
            group["lr"] = options.learning_rate
        sums: Counter = Counter()
        with self.lock:
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            batches = micro_batches(sequences, options.micro_batch_tokens)
            for batch in tqdm(batches, desc=desc, unit="batch", leave=False):
                terms = self._forward(batch, options)
                (terms["loss"] / total_trained).backward()
                sums.update({k: float(v.detach()) for k, v in terms.items()})
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, options.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
        computed = sum(len(b) * max(len(s.token_ids) for s in b) for b in batches)
        metrics.update({
            "loss": sums["loss"] / total_trained,
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
        return metrics

    def _forward(self, batch: list[Sequence], options: TrainOptions) -> dict[str, torch.Tensor]:
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
        advantages = torch.tensor([s.advantage for s in batch])  # [rows]
        logits = self.model(input_ids=ids, attention_mask=attention).logits  # [rows, tokens, vocab]
        new = token_logprobs(logits[:, :-1], ids[:, 1:])  # [rows, tokens-1]
        ref = None
        if options.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref_logits = self.model(input_ids=ids, attention_mask=attention).logits
                ref = token_logprobs(ref_logits[:, :-1], ids[:, 1:])
        return policy_loss_terms(
            new, old[:, 1:], advantages, mask[:, 1:],
            epsilon=options.epsilon, epsilon_high=options.epsilon_high,
            beta=options.beta, ref_logprobs=ref,
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
    for group in groups:
        trajectories = list(group.trajectories)
        rewards = [float(t.reward) for t in trajectories]
        if len(set(rewards)) < 2:
            issues[EQUAL_REWARDS] += 1
            continue
        trained_groups += 1
        for trajectory, advantage in zip(trajectories, group_advantages(rewards, scale_rewards=options.scale_rewards)):
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
        "choice_without_token_ids": "choices without prompt_token_ids/token_ids (not from an art backend?)",
        "choice_without_logprobs": "choices without logprobs matching their token ids",
        "assistant_message_dict_not_trained": "assistant turns given as dicts are context only; append the Choice to train it",
        "trajectory_without_trainable_choice": "trajectories with no trainable Choice",
    }
    return "; ".join(f"{n} x {hints.get(reason, reason)}" for reason, n in sorted(issues.items()))



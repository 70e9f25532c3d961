"""Our GRPO loss against a peer's standalone implementation: verl 0.9.1 (`verl.trainer.ppo.core_algos`).

The same float64 tensors go through `policy_loss_terms` and through verl; the loss values and the
gradients w.r.t. the new logprobs must agree. verl is configured with its own `ActorConfig`, and
gets the whole-batch counts its trainer writes into `config.global_batch_info`, so both sides
normalise by the same batch-level numbers (and a micro-batch's loss is its share on both sides).

Option mapping (ours -> verl):
    ppo=True, epsilon / epsilon_high     -> policy_loss "vanilla", clip_ratio_low / _high (dual-clip off)
    importance_sampling_level="sequence" -> policy_loss "gspo"
    ppo=False (CISPO)                    -> policy_loss "cispo"
    loss_normalization token / sequence / constant
                                         -> loss_agg_mode token-mean / seq-mean-token-mean /
                                            seq-mean-token-sum-norm (loss_scale_factor = max_tokens_normalizer)
    beta (k3 KL)                         -> use_kl_loss, kl_loss_type "low_var_kl", kl_loss_coef
    truncated_importance_sampling with precalculated logprobs
                                         -> rollout correction, rollout_is="token", rollout_is_threshold
    group_advantages(scale_rewards)      -> GRPO outcome advantage (norm_adv_by_std_in_grpo)

Not compared: TRL (its GRPO loss exists only inside `GRPOTrainer._compute_loss`, which runs the
model), verl's dual-clip (we have none: `clip_ratio_c` is set out of reach), and our TIS without
precalculated logprobs (verl's bypass mode deliberately drops the IS weight under PPO-clip).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import ActorConfig, PolicyLossConfig

from art.training.advantages import group_advantages, reward_std
from art.training.loss import Normalizer, policy_loss_terms

VERL_AGG_MODE = {"token": "token-mean", "sequence": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm"}
NORMALIZATIONS = list(VERL_AGG_MODE)
MAX_TOKENS = 11  # "constant" length; deliberately not the padded width, so verl must be told it
DUAL_CLIP_OFF = 1e6  # verl's lower bound for negative advantages; we have no dual-clip
TIGHT = {"rtol": 1e-6, "atol": 1e-9}  # float64: the two only differ in summation order


@dataclass
class Batch:
    """One step's tensors; padding holds finite garbage that both sides must ignore."""

    new: torch.Tensor  # [rows, tokens] trainer logprobs (the leaf we differentiate)
    old: torch.Tensor  # [rows, tokens] logprobs the ratio is taken against
    ref: torch.Tensor  # [rows, tokens] reference-model logprobs (KL)
    sampler: torch.Tensor  # [rows, tokens] the inference engine's logprobs (TIS)
    advantages: torch.Tensor  # [rows]
    mask: torch.Tensor  # [rows, tokens] float, 1.0 where trained

    def rows(self, part: slice) -> "Batch":
        """A micro-batch of whole rows, padded only to its own longest row."""
        width = int(self.mask[part].sum(1).max())
        cut = (part, slice(0, width))
        return Batch(self.new[cut], self.old[cut], self.ref[cut], self.sampler[cut], self.advantages[part],
                     self.mask[cut])


def random_batch(seed: int = 0) -> Batch:
    """Ragged rows (one of a single token) with ratios spread wide enough that every clip bound bites."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 3, 6, 1, 9, 5, 7, 2]
    width = max(lengths)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths], dtype=torch.float64)

    def noise(scale):
        return torch.randn(len(lengths), width, generator=g, dtype=torch.float64) * scale

    new = noise(0.5) - 1.5
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, -0.3, 0.9, 1.1, -0.2], dtype=torch.float64)
    return Batch(new=new, old=new + noise(0.3), ref=new + noise(0.4), sampler=new + noise(0.3),
                 advantages=advantages, mask=mask)


def whole_batch_normalizer(batch: Batch, mode: str) -> Normalizer:
    return Normalizer(mode, trained_tokens=int(batch.mask.sum()), sequences=batch.mask.shape[0],
                      max_tokens=MAX_TOKENS)


def verl_config(batch: Batch, mode: str, loss_mode: str, epsilon: float, epsilon_high: float) -> ActorConfig:
    """The minimal ActorConfig, with the whole-batch counts verl's `ppo_loss` puts in global_batch_info."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=batch.mask.shape[0],
        clip_ratio=epsilon,
        clip_ratio_low=epsilon,
        clip_ratio_high=epsilon_high,
        clip_ratio_c=DUAL_CLIP_OFF,
        loss_agg_mode=VERL_AGG_MODE[mode],
        loss_scale_factor=MAX_TOKENS,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        global_batch_info={
            "dp_size": 1,
            "batch_num_tokens": int(batch.mask.sum()),
            "global_batch_size": batch.mask.shape[0],
            "loss_scale_factor": MAX_TOKENS,
        },
    )


def our_loss(batch: Batch, normalizer: Normalizer, **options) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, d loss / d new logprobs, terms) from `policy_loss_terms`."""
    new = batch.new.clone().requires_grad_(True)
    terms = policy_loss_terms(new, batch.old, batch.advantages, batch.mask, ref_logprobs=batch.ref,
                              normalizer=normalizer, **options)
    terms["loss"].backward()
    return terms["loss"].detach(), new.grad, terms


def verl_loss(batch: Batch, config: ActorConfig, *, kl_coef: float = 0.0, tis_cap: float | None = None):
    """(loss, d loss / d new logprobs) assembled as verl's `workers.utils.losses.ppo_loss` does it:
    the registered policy loss (with rollout-correction weights), plus kl_coef * agg_loss(k3 KL)."""
    new = batch.new.clone().requires_grad_(True)
    mask = batch.mask.bool()  # ppo_loss hands the policy loss a bool response mask
    weights = None
    if tis_cap is not None:
        proto, _, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=batch.old, rollout_log_prob=batch.sampler, response_mask=mask,
            rollout_is="token", rollout_is_threshold=tis_cap)
        weights = proto.batch["rollout_is_weights"]
    policy_loss = core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)
    loss, _ = policy_loss(old_log_prob=batch.old, log_prob=new, advantages=batch.advantages[:, None] * batch.mask,
                          response_mask=mask, loss_agg_mode=config.loss_agg_mode, config=config,
                          rollout_is_weights=weights)
    if kl_coef:
        kl = core_algos.kl_penalty(logprob=new, ref_logprob=batch.ref, kl_penalty="low_var_kl")
        loss = loss + kl_coef * core_algos.agg_loss(kl, mask, config.loss_agg_mode, **config.global_batch_info)
    loss.backward()
    return loss.detach(), new.grad


def assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], **TIGHT)
    torch.testing.assert_close(ours[1], theirs[1], **TIGHT)


# -- policy objectives ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", NORMALIZATIONS)
@pytest.mark.parametrize("epsilon, epsilon_high", [(0.2, 0.2), (0.2, 0.28)], ids=["symmetric", "clip-higher"])
def test_ppo_clip_matches_verl_vanilla(mode, epsilon, epsilon_high):
    batch = random_batch()
    loss, grad, terms = our_loss(batch, whole_batch_normalizer(batch, mode), epsilon=epsilon,
                                 epsilon_high=epsilon_high)
    theirs = verl_loss(batch, verl_config(batch, mode, "vanilla", epsilon, epsilon_high))
    assert_same((loss, grad), theirs)
    assert 0 < terms["clipped_tokens"] < batch.mask.sum()  # both branches of the min are exercised


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_gspo_matches_verl_gspo(mode):
    """Sequence ratio s_i on every token, with GSPO-token's gradient; some sequences clipped, some not."""
    batch = random_batch(1)
    loss, grad, terms = our_loss(batch, whole_batch_normalizer(batch, mode), epsilon=0.03, epsilon_high=0.04,
                                 importance_sampling_level="sequence")
    theirs = verl_loss(batch, verl_config(batch, mode, "gspo", 0.03, 0.04))
    assert_same((loss, grad), theirs)
    assert 0 < terms["clipped_tokens"] < batch.mask.sum()


@pytest.mark.parametrize("mode", NORMALIZATIONS)
@pytest.mark.parametrize("epsilon, epsilon_high", [(1.0, 4.0), (0.2, 0.28)], ids=["art-defaults", "tight"])
def test_cispo_matches_verl_cispo(mode, epsilon, epsilon_high):
    batch = random_batch(2)
    loss, grad, _ = our_loss(batch, whole_batch_normalizer(batch, mode), epsilon=epsilon,
                             epsilon_high=epsilon_high, ppo=False)
    theirs = verl_loss(batch, verl_config(batch, mode, "cispo", epsilon, epsilon_high))
    assert_same((loss, grad), theirs)


# -- KL penalty and truncated importance sampling --------------------------------------------

@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_k3_kl_penalty_matches_verl_low_var_kl(mode):
    """beta * k3 is normalised like the policy terms on both sides (verl: agg_loss with the same mode)."""
    batch = random_batch(3)
    loss, grad, terms = our_loss(batch, whole_batch_normalizer(batch, mode), epsilon=0.2, beta=0.1)
    theirs = verl_loss(batch, verl_config(batch, mode, "vanilla", 0.2, 0.2), kl_coef=0.1)
    assert_same((loss, grad), theirs)
    new = batch.new.clone().requires_grad_(True)
    verl_kl = core_algos.kl_penalty(logprob=new, ref_logprob=batch.ref, kl_penalty="low_var_kl")
    torch.testing.assert_close(terms["kl"], (verl_kl * batch.mask).sum(), **TIGHT)


@pytest.mark.parametrize("mode", NORMALIZATIONS)
@pytest.mark.parametrize("objective, loss_mode", [
    ({}, "vanilla"),
    ({"importance_sampling_level": "sequence", "epsilon_high": 0.25}, "gspo"),
    ({"ppo": False, "epsilon": 1.0, "epsilon_high": 4.0}, "cispo"),
], ids=["ppo", "gspo", "cispo"])
def test_tis_with_precalculated_logprobs_matches_verl_rollout_correction(mode, objective, loss_mode):
    """Ours: L_t *= sg(min(exp(logp_old - logp_sampler), C)). verl (decoupled mode): token-level
    rollout IS weights min(exp(old_log_prob - rollout_log_prob), C) multiplied into the policy loss."""
    batch = random_batch(4)
    options = {"epsilon": 0.2, **objective}
    loss, grad, terms = our_loss(batch, whole_batch_normalizer(batch, mode), sampler_logprobs=batch.sampler,
                                 truncated_importance_sampling=1.3, **options)
    config = verl_config(batch, mode, loss_mode, options["epsilon"], options.get("epsilon_high", options["epsilon"]))
    assert_same((loss, grad), verl_loss(batch, config, tis_cap=1.3))
    assert terms["tis_truncated"] > 0  # the cap bites


# -- micro-batches ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_micro_batch_shares_match_verl_global_batch_info(mode):
    """Each micro-batch's loss is its share of the step on both sides: our Normalizer's counts and
    verl's global_batch_info carry the same whole-batch numbers."""
    batch = random_batch(5)
    normalizer = whole_batch_normalizer(batch, mode)
    config = verl_config(batch, mode, "vanilla", 0.2, 0.28)
    for part in (slice(0, 3), slice(3, 8)):
        micro = batch.rows(part)
        ours = our_loss(micro, normalizer, epsilon=0.2, epsilon_high=0.28, beta=0.05)[:2]
        assert_same(ours, verl_loss(micro, config, kl_coef=0.05))


# -- advantages ------------------------------------------------------------------------------

GROUPS = [[1.0, 0.0, 0.0, 0.0], [0.5, 0.2, 0.9], [1.0, 1.0, 1.0, 1.0], [0.3, -0.7], [2.0, 0.0, 1.0, 0.5, 0.25]]


def verl_group_advantages(estimator: str, norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    """verl's GRPO outcome advantage for GROUPS, one value per response (reward on its last token)."""
    rewards = [r for group in GROUPS for r in group]
    index = np.array([f"prompt-{i}" for i, group in enumerate(GROUPS) for _ in group], dtype=object)
    lengths = torch.tensor([2 + i % 4 for i in range(len(rewards))])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = torch.tensor(rewards, dtype=torch.float64)
    advantages, _ = core_algos.get_adv_estimator_fn(estimator)(
        token_level_rewards=token_rewards, response_mask=mask, index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    assert torch.equal(advantages, advantages[:, :1] * mask)  # one value per response, on its tokens
    return advantages[:, 0].double()


@pytest.mark.parametrize("estimator", ["grpo", "grpo_vectorized"])
def test_unscaled_group_advantages_match_verl(estimator):
    """Dr. GRPO (scale_rewards=False) == verl's norm_adv_by_std_in_grpo=False: r - mean(group)."""
    ours = torch.tensor([a for group in GROUPS for a in group_advantages(group, scale_rewards=False)],
                        dtype=torch.float64)
    tolerance = TIGHT if estimator == "grpo" else {"rtol": 1e-6, "atol": 1e-6}  # vectorized runs in float32
    torch.testing.assert_close(ours, verl_group_advantages(estimator, False), **tolerance)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_vectorized"])
def test_std_scaled_group_advantages_differ_from_verl_only_by_the_std_convention(estimator):
    """Documented divergence: we divide by the population std (as ART), verl by the Bessel-corrected
    sample std (torch.std). Swapping verl's std for ours reproduces our advantages exactly."""
    ours = torch.tensor([a for group in GROUPS for a in group_advantages(group, scale_rewards=True)],
                        dtype=torch.float64)
    population = torch.tensor([reward_std(group) for group in GROUPS for _ in group], dtype=torch.float64)
    sample = torch.tensor([torch.tensor(group, dtype=torch.float64).std().item() for group in GROUPS
                           for _ in group], dtype=torch.float64)
    theirs = verl_group_advantages(estimator, True)
    tolerance = TIGHT if estimator == "grpo" else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(theirs * (sample + 1e-6) / (population + 1e-6), ours, **tolerance)
    # the size of the gap, on the first group [1, 0, 0, 0]: sqrt(3)/1 vs 0.75 / 0.5
    assert float(ours[0]) == pytest.approx(3**0.5, rel=1e-5)
    assert float(theirs[0]) == pytest.approx(1.5, rel=1e-5)

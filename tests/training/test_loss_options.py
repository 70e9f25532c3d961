"""Loss options: hand-computed values, gradients, micro-batch invariance, validation.

Most cases use one small batch of two sequences (padded to 3 tokens):
    seq A (A = +1): new = [log .5, log .9],        old = [log .25, log .9]      -> ratio [2, 1]
    seq B (A = -1): new = [log .2, log .5, log .8], old = [log .4, log .5, log .8] -> ratio [.5, 1, 1]
"""

import copy
import math

import pytest
import torch

import art
from art.training.advantages import balance_advantage, group_advantages, reward_std
from art.training.batch import prepare_batch
from art.training.loss import Normalizer, policy_loss_terms
from art.training.options import TrainOptions

L = math.log
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -1.0])


def batch():
    new = torch.tensor([[L(0.5), L(0.9), 0.0], [L(0.2), L(0.5), L(0.8)]], requires_grad=True)
    old = torch.tensor([[L(0.25), L(0.9), 0.0], [L(0.4), L(0.5), L(0.8)]])
    return new, old


def close(tensor, expected, atol=1e-6):
    return torch.allclose(tensor, torch.tensor(expected), atol=atol)


def loss_and_grad(**kwargs):
    new, old = batch()
    terms = policy_loss_terms(new, old, ADV, MASK, **kwargs)
    terms["loss"].backward()
    return terms, new.grad


# -- policy objective -----------------------------------------------------------------------

def test_ppo_token_level_hand_values():
    terms, grad = loss_and_grad(epsilon=0.2)
    # A: ratio 2 -> min(2, 1.2) = 1.2 -> -1.2 (clipped); ratio 1 -> -1.      sum -2.2
    # B: ratio .5, A=-1 -> min(-.5, -.8) = -.8 -> +.8 (clipped); then +1, +1. sum 2.8
    assert float(terms["loss"].detach()) == pytest.approx(0.6, abs=1e-6)
    assert float(terms["clipped_tokens"]) == 2.0
    # clipped tokens get no gradient; the others get -ratio * A
    assert close(grad, [[0.0, -1.0, 0.0], [0.0, 1.0, 1.0]])


def test_cispo_hand_values_and_gradient_only_through_logp_new():
    # ART's CISPO defaults: eps 1.0, eps_high 4.0 -> weight = clip(ratio, 0, 5) = ratio here
    eps, eps_high = TrainOptions(ppo=False).clip_range()
    assert (eps, eps_high) == (1.0, 4.0)
    terms, grad = loss_and_grad(epsilon=eps, epsilon_high=eps_high, ppo=False)
    # L_t = -w_t * A * logp_new_t
    # A: -(2 * log .5) - (1 * log .9);  B: +(.5 * log .2) + log .5 + log .8
    expected = -(2 * L(0.5) + L(0.9)) + (0.5 * L(0.2) + L(0.5) + L(0.8))
    assert float(terms["loss"].detach()) == pytest.approx(expected, abs=1e-6)  # = -0.229355
    # the weight is detached: dL/dlogp_new = -w * A exactly (no ratio derivative term)
    assert close(grad, [[-2.0, -1.0, 0.0], [0.5, 1.0, 1.0]])
    # with a tight clip the weight is clipped to [.8, 1.2] but every token keeps a gradient
    terms, grad = loss_and_grad(epsilon=0.2, ppo=False)
    assert float(terms["clipped_tokens"]) == 2.0
    assert close(grad, [[-1.2, -1.0, 0.0], [0.8, 1.0, 1.0]])


def test_gspo_sequence_ratio_shared_by_all_tokens():
    terms, grad = loss_and_grad(epsilon=0.3, importance_sampling_level="sequence")
    # s_A = exp((log 2 + 0) / 2) = sqrt 2 = 1.4142 > 1.3 -> clipped: -1.3 per token, no grad
    # s_B = exp((log .5 + 0 + 0) / 3) = .5 ** (1/3) = .7937 in [.7, 1.3]: +.7937 per token
    s_b = 0.5 ** (1 / 3)
    assert float(terms["loss"].detach()) == pytest.approx(-2 * 1.3 + 3 * s_b, abs=1e-6)
    assert float(terms["ratio"].detach()) == pytest.approx(2 * math.sqrt(2) + 3 * s_b, abs=1e-6)
    # GSPO-token gradient: every token of B gets d/dlogp_t (-A * s_t) = s_B
    assert close(grad, [[0.0, 0.0, 0.0], [s_b, s_b, s_b]])


def test_gspo_gradient_equals_the_sequence_objective():
    # GSPO: J = (1/G) sum_i -min(s_i A_i, clip(s_i) A_i), s_i differentiable; "sequence"
    # normalisation of the token form must give the same gradient.
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    new0 = torch.randn(3, 4) * 0.1 - 1
    old = new0 + torch.randn(3, 4) * 0.1
    adv = torch.tensor([0.7, -1.3, 0.4])
    new = new0.clone().requires_grad_(True)
    norm = Normalizer("sequence", trained_tokens=int(mask.sum()), sequences=3)
    policy_loss_terms(new, old, adv, mask, epsilon=0.05, importance_sampling_level="sequence",
                      normalizer=norm)["loss"].backward()
    ref = new0.clone().requires_grad_(True)
    s = torch.exp(((ref - old) * mask).sum(1) / mask.sum(1))
    (-torch.minimum(s * adv, s.clamp(0.95, 1.05) * adv)).mean().backward()
    assert torch.allclose(new.grad, ref.grad * mask, atol=1e-6)


# -- normalisation --------------------------------------------------------------------------

def test_normalisation_modes_hand_values():
    # PPO token losses: A [-1.2, -1] (2 tokens), B [.8, 1, 1] (3 tokens); 5 tokens, 2 sequences
    cases = {
        Normalizer("token", trained_tokens=5, sequences=2): 0.6 / 5,  # 0.12
        Normalizer("sequence", trained_tokens=5, sequences=2): (-2.2 / 2 + 2.8 / 3) / 2,  # -0.08333
        Normalizer("constant", trained_tokens=5, sequences=2, max_tokens=4): 0.6 / (2 * 4),  # 0.075
    }
    for norm, expected in cases.items():
        terms, _ = loss_and_grad(epsilon=0.2, normalizer=norm)
        assert float(terms["loss"].detach()) == pytest.approx(expected, abs=1e-6), norm.mode


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
@pytest.mark.parametrize("objective", [
    {}, {"ppo": False, "epsilon": 1.0, "epsilon_high": 4.0}, {"importance_sampling_level": "sequence"},
    {"truncated_importance_sampling": 1.1},
])
def test_normalisation_invariant_to_micro_batching(mode, objective):
    torch.manual_seed(1)
    rows, width = 5, 6
    lengths = [2, 6, 3, 5, 1]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    new0 = torch.randn(rows, width) * 0.2 - 1
    old = new0 + torch.randn(rows, width) * 0.2
    ref = new0 + torch.randn(rows, width) * 0.2
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8])
    norm = Normalizer(mode, trained_tokens=int(mask.sum()), sequences=rows, max_tokens=8)
    kwargs = {"epsilon": 0.2, "beta": 0.05, "normalizer": norm, **objective}

    whole = new0.clone().requires_grad_(True)
    total = policy_loss_terms(whole, old, adv, mask, ref_logprobs=ref, **kwargs)["loss"]
    total.backward()

    split = new0.clone().requires_grad_(True)
    summed = 0.0
    for part in (slice(0, 2), slice(2, 5)):
        n = int(mask[part].sum(1).max())  # each micro-batch padded only to its own width
        cut = (part, slice(0, n))
        share = policy_loss_terms(split[cut], old[cut], adv[part], mask[cut], ref_logprobs=ref[cut],
                                  **kwargs)["loss"]
        share.backward()
        summed += float(share.detach())
    assert summed == pytest.approx(float(total.detach()), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-7)


def test_ppo_reproduces_the_clipped_surrogate_exactly():
    def today(new, old_logprobs, advantages, mask, epsilon, beta, ref):  # the loss before options
        old = torch.where(mask > 0, old_logprobs, new.detach())
        ratio = torch.exp(new - old)
        adv = advantages[:, None]
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
        delta = ref - new
        return ((per_token + beta * (torch.exp(delta) - delta - 1)) * mask).sum()

    torch.manual_seed(2)
    mask = (torch.rand(4, 7) > 0.3).float()
    new0 = torch.randn(4, 7) * 0.3 - 1
    old = new0 + torch.randn(4, 7) * 0.3
    ref = new0 + torch.randn(4, 7) * 0.3
    adv = torch.randn(4)
    total = int(mask.sum())
    options = TrainOptions(beta=0.04, ppo=True)
    epsilon, epsilon_high = options.clip_range()
    a = new0.clone().requires_grad_(True)
    norm = Normalizer(options.loss_normalization, total, 4, options.max_tokens_normalizer)
    got = policy_loss_terms(a, old, adv, mask, epsilon=epsilon, epsilon_high=epsilon_high, beta=options.beta,
                            ref_logprobs=ref, ppo=options.ppo,
                            importance_sampling_level=options.importance_sampling_level,
                            truncated_importance_sampling=options.truncated_importance_sampling,
                            normalizer=norm)["loss"]
    got.backward()
    b = new0.clone().requires_grad_(True)
    want = today(b, old, adv, mask, 0.2, 0.04, ref) / total
    want.backward()
    assert torch.equal(got, want) and torch.equal(a.grad, b.grad)


# -- truncated importance sampling ----------------------------------------------------------

def test_tis_with_precalculated_logprobs():
    new, _ = batch()
    before = new.detach().clone()  # pre-update trainer logprobs: the PPO ratio is exactly 1
    # sampler chosen so exp(before - sampler) = [2, .5] and [4, 1, 1]; cap 2 -> [2, .5], [2, 1, 1]
    sampler = before - torch.tensor([[L(2), L(0.5), 0.0], [L(4), 0.0, 0.0]])
    terms = policy_loss_terms(new, before, ADV, MASK, epsilon=0.2, sampler_logprobs=sampler,
                              truncated_importance_sampling=2.0)
    # ratio 1 -> token loss -A: A [-1, -1] x [2, .5] = -2.5;  B [1, 1, 1] x [2, 1, 1] = 4
    assert float(terms["loss"].detach()) == pytest.approx(1.5, abs=1e-6)
    assert float(terms["tis_weight"].detach()) == pytest.approx(6.5, abs=1e-6)  # mean 1.3 over 5 tokens
    assert float(terms["tis_truncated"]) == 1.0
    assert float(terms["clipped_tokens"]) == 0.0
    terms["loss"].backward()  # the weight is detached: gradient = -A * w
    assert close(new.grad, [[-2.0, -0.5, 0.0], [2.0, 1.0, 1.0]])


def test_tis_without_precalculation_uses_the_ratio_to_the_sampler():
    # old = sampler: w = min(exp(sg(new) - sampler), 1.5) = [1.5, 1], [.5, 1, 1]
    terms, grad = loss_and_grad(epsilon=0.2, truncated_importance_sampling=1.5)
    # PPO tokens A [-1.2, -1] x [1.5, 1] = -2.8;  B [.8, 1, 1] x [.5, 1, 1] = 2.4
    assert float(terms["loss"].detach()) == pytest.approx(-0.4, abs=1e-6)
    assert float(terms["tis_weight"].detach()) == pytest.approx(5.0, abs=1e-6)
    assert float(terms["tis_truncated"]) == 1.0
    assert close(grad, [[0.0, -1.0, 0.0], [0.0, 1.0, 1.0]])


# -- advantages -----------------------------------------------------------------------------

def test_scale_rewards_modes():
    # batch rewards [1, 0, 2, 0]: mean .75, population var (.0625+.5625+1.5625+.5625)/4 = .6875
    std = reward_std([1.0, 0.0, 2.0, 0.0])
    assert std == pytest.approx(math.sqrt(0.6875))  # 0.829156
    assert group_advantages([2.0, 0.0], scale_rewards="group") == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group_advantages([2.0, 0.0], scale_rewards="batch", batch_std=std) == pytest.approx(
        [1 / 0.829156, -1 / 0.829156], abs=1e-5)  # ±1.206045
    assert group_advantages([2.0, 0.0], scale_rewards="none") == [1.0, -1.0]
    assert group_advantages([2.0, 0.0], scale_rewards=False) == [1.0, -1.0]

    groups = [group_of([1.0, 0.0]), group_of([2.0, 0.0])]
    got = {}
    for mode in (True, "batch", "none"):
        sequences, _, _ = prepare_batch(groups, TrainOptions(scale_rewards=mode))
        got[mode] = sorted(s.advantage for s in sequences)
    assert got[True] == pytest.approx([-1, -1, 1, 1], abs=1e-5)
    assert got["batch"] == pytest.approx([-1.206045, -0.603023, 0.603023, 1.206045], abs=1e-5)
    assert got["none"] == pytest.approx([-1, -0.5, 0.5, 1])


def test_advantage_balance():
    assert balance_advantage(-1.0, 0.5) == -0.5  # b > 0: negatives x (1 - b)
    assert balance_advantage(1.0, 0.5) == 1.0
    assert balance_advantage(1.0, -0.25) == 0.75  # b < 0: positives x (1 + b)
    assert balance_advantage(-1.0, -0.25) == -1.0
    assert balance_advantage(-1.0, 0.0) == -1.0
    # b = 1: only positive advantages remain (the zeroed ones carry no gradient and are dropped)
    sequences, _, _ = prepare_batch([group_of([1.0, 0.0])], TrainOptions(advantage_balance=1.0))
    assert [s.advantage for s in sequences] == pytest.approx([1.0], abs=1e-5)
    sequences, _, _ = prepare_batch([group_of([1.0, 0.0])], TrainOptions(advantage_balance=-0.5))
    assert sorted(s.advantage for s in sequences) == pytest.approx([-1.0, 0.5], abs=1e-5)


# -- entropy bonus --------------------------------------------------------------------------

ENTROPY = torch.tensor([[0.7, 0.1, 9.0], [0.3, 0.2, 0.4]])  # 9.0 sits outside the mask


def test_entropy_bonus_hand_values_and_gradient():
    base, _ = loss_and_grad(epsilon=0.2)
    entropy = ENTROPY.clone().requires_grad_(True)
    new, old = batch()
    terms = policy_loss_terms(new, old, ADV, MASK, epsilon=0.2, entropy=entropy, entropy_bonus=0.5)
    terms["loss"].backward()
    # masked entropies sum to 0.7 + 0.1 + 0.3 + 0.2 + 0.4 = 1.7; the loss drops by 0.5 x 1.7
    assert float(terms["entropy"]) == pytest.approx(1.7)
    assert float(terms["loss"].detach()) == pytest.approx(float(base["loss"].detach()) - 0.85, abs=1e-6)
    assert close(entropy.grad, [[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5]])  # raising entropy lowers the loss


def test_entropy_is_reported_but_trains_nothing_at_bonus_zero():
    entropy = ENTROPY.clone().requires_grad_(True)
    new, old = batch()
    terms = policy_loss_terms(new, old, ADV, MASK, epsilon=0.2, entropy=entropy)
    terms["loss"].backward()
    assert float(terms["entropy"]) == pytest.approx(1.7) and entropy.grad is None


def test_token_entropy_from_the_same_logits_as_the_logprob():
    from art.training.logprobs import _chunk_with_entropy

    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    targets = torch.tensor([0, 3, 10, 4, 4])
    logprob, entropy = _chunk_with_entropy(lambda h: h, logits, targets)
    p = torch.softmax(logits, dim=-1)
    assert torch.allclose(logprob, torch.log(p[torch.arange(5), targets]), atol=1e-6)
    assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-6)


def test_regularizers_act_on_groups_with_equal_rewards_too():
    """Without KL or entropy terms a group whose rewards are all equal trains nothing and is
    skipped; with either, its samples are kept at advantage 0 so the regularizer acts on them."""
    from art.training.batch import EQUAL_REWARDS

    groups = [group_of([1.0, 0.0]), group_of([0.5, 0.5, 0.5], prompt=(2, 1, 1))]
    plain, issues, stats = prepare_batch(groups, TrainOptions())
    assert len(plain) == 2 and issues[EQUAL_REWARDS] == 1 and stats["groups_trained"] == 1
    for options in (TrainOptions(beta=0.1), TrainOptions(entropy_bonus=0.01)):
        kept, issues, stats = prepare_batch(groups, options)
        assert len(kept) == 5 and not issues and stats["groups_trained"] == 1
        assert [s.advantage for s in kept if s.group == 1] == [0.0, 0.0, 0.0]


# -- options --------------------------------------------------------------------------------

def test_clip_defaults_follow_the_objective():
    assert TrainOptions().clip_range() == (1.0, 4.0)  # CISPO, ART's default
    assert TrainOptions(ppo=True).clip_range() == (0.2, 0.2)
    assert TrainOptions(ppo=True, epsilon_high=0.28).clip_range() == (0.2, 0.28)
    assert TrainOptions(ppo=False).clip_range() == (1.0, 4.0)
    assert TrainOptions(ppo=False, epsilon=0.5).clip_range() == (0.5, 4.0)


def test_validation_lists_every_bad_field():
    with pytest.raises(art.ArtValueError) as info:
        TrainOptions.build(None, {
            "ppo": "yes", "importance_sampling_level": "seq", "loss_normalization": "constant",
            "scale_rewards": "batchy", "advantage_balance": 2, "truncated_importance_sampling": 0,
            "precalculate_logprobs": 1, "epsilon": -1, "entropy_bonus": -0.1,
        })
    message = str(info.value)
    for name in ("ppo", "importance_sampling_level", "max_tokens_normalizer", "scale_rewards",
                 "advantage_balance", "truncated_importance_sampling", "precalculate_logprobs", "epsilon",
                 "entropy_bonus"):
        assert name in message, name
    with pytest.raises(art.ArtValueError, match="loss_normalization.*max_tokens_normalizer"):
        TrainOptions.build(None, {"max_tokens_normalizer": 0, "loss_normalization": "bogus"})
    ok = TrainOptions.build(None, {"loss_normalization": "constant", "max_tokens_normalizer": 512,
                                   "scale_rewards": "batch", "ppo": False, "truncated_importance_sampling": 2.0})
    assert ok.reward_scaling == "batch" and ok.clip_range() == (1.0, 4.0)


# -- through the trainer --------------------------------------------------------------------

def group_of(rewards, prompt=(1, 2)):
    from tests.support.fakes import make_choice

    return art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[make_choice(list(prompt), [3 + i, 4, 5 + i][: 2 + i % 2],
                                                         [-1.0, -0.7, -1.3][: 2 + i % 2])], reward=r)
        for i, r in enumerate(rewards)
    ])


def tiny_trainer(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from art.training.trainer import Trainer

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                                init_lora_weights=False))
    return Trainer(model, type("Tok", (), {"pad_token_id": 0})())


def lora_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_trainer_precalculated_logprobs_and_tis_metrics():
    trainer = tiny_trainer()
    groups = [group_of([1.0, 0.0, 0.5]), group_of([0.0, 1.0], prompt=(2, 1, 1))]
    metrics = trainer.step(groups, TrainOptions(precalculate_logprobs=True, truncated_importance_sampling=2.0,
                                                learning_rate=1e-3))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # ratio against the pre-update policy
    assert metrics["clip_fraction"] == 0.0
    assert 0 < metrics["tis_weight_mean"] <= 2.0 and 0 <= metrics["tis_truncated_fraction"] <= 1


def test_trainer_entropy_bonus_raises_the_entropy_it_reports():
    """The same step with and without the bonus: the bonus moves the weights towards a flatter
    policy, so the next step's reported entropy (before any update) is higher."""
    groups = [group_of([1.0, 0.0, 0.5]), group_of([0.0, 1.0], prompt=(2, 1, 1))]
    after = {}
    for bonus in (0.0, 1.0):
        trainer = tiny_trainer()
        first = trainer.step(copy.deepcopy(groups), TrainOptions(learning_rate=5e-2, max_grad_norm=1e6,
                                                                 entropy_bonus=bonus))
        assert 0 < first["entropy"] <= math.log(16)  # a 16-token vocabulary
        after[bonus] = trainer.step(copy.deepcopy(groups), TrainOptions(learning_rate=1e-9))["entropy"]
    assert after[1.0] > after[0.0]


@pytest.mark.parametrize("options", [
    {"loss_normalization": "sequence"}, {"entropy_bonus": 0.1}, {"loss_normalization": "constant", "max_tokens_normalizer": 8},
    {"ppo": False, "importance_sampling_level": "sequence"},
])
def test_trainer_update_does_not_depend_on_micro_batch_size(options):
    groups = [group_of([1.0, 0.0, 0.5]), group_of([0.0, 1.0], prompt=(2, 1, 1))]
    results = []
    for micro in (4, 4096):  # one row per micro-batch vs one micro-batch for all
        trainer = tiny_trainer()
        trainer.step(copy.deepcopy(groups), TrainOptions(micro_batch_tokens=micro, learning_rate=1e-3,
                                                         max_grad_norm=1e6, **options))
        results.append(lora_weights(trainer))
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], atol=1e-6), name

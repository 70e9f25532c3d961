"""Live-adapter batches run on merged weights: same outputs, exact unmerge, never trained merged."""

from types import SimpleNamespace

import pytest
import torch

from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef, SamplingParams
from art.engine.llm_engine import LLMEngine
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from tests.support.fakes import randomize_lora


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}


def test_merged_forward_equals_the_lora_path_and_unmerges_exactly(lora):
    model, _ = lora
    ids = torch.tensor([[3, 17, 99, 250, 7, 41]])
    before = base_weights(model)
    with torch.no_grad():
        lora_path = model(input_ids=ids).logits.log_softmax(-1)
        adapters = AdapterSet(model)
        with adapters.activate(["default"]) as extra:
            assert extra == {}
            merged_path = model(input_ids=ids).logits.log_softmax(-1)
        assert any(getattr(m, "merged", False) for m in model.modules())
        with adapters.activate(["default", "__base__"]) as extra:  # a mixed batch unmerges first
            assert not any(getattr(m, "merged", False) for m in model.modules())
            mixed = model(input_ids=ids.repeat(2, 1), **extra).logits.log_softmax(-1)
    torch.testing.assert_close(merged_path, lora_path, atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[0], lora_path[0], atol=1e-5, rtol=0)
    after = base_weights(model)
    assert all(torch.equal(after[n], before[n]) for n in before)  # bit-exact, not W + BA - BA


def test_the_trainer_refuses_merged_weights(lora):
    model, _ = lora
    adapters = AdapterSet(model)
    with adapters.activate(["default"]):
        pass
    with pytest.raises(RuntimeError, match="unmerge"):
        Trainer(model, SimpleNamespace(pad_token_id=0)).step([], TrainOptions())
    adapters.unmerge()
    assert Trainer(model, SimpleNamespace(pad_token_id=0)).step([], TrainOptions())["nothing_to_train"] == 1.0


async def test_engine_serves_new_lora_weights_after_an_update(lora):
    """The merged copy is rebuilt after `paused()` + `weights_updated()`, not served stale."""
    model, tokenizer = lora
    adapters = AdapterSet(model, live_step=1)
    engine = LLMEngine(model, tokenizer, adapters=adapters, max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=5)
        live = AdapterRef("tiny", None, None)
        first = (await engine.generate([5, 9, 13, 200], params, live))[0]
        with engine.paused():
            randomize_lora(model, seed=6)  # what a training step does to the live adapter
            engine.weights_updated(2)
        second = (await engine.generate([5, 9, 13, 200], params, live))[0]
        ids = torch.tensor([[5, 9, 13, 200] + second.token_ids])
        with torch.no_grad():  # unmerged LoRA path, straight through peft
            adapters.unmerge()
            expected = model(input_ids=ids).logits[0, 3:-1].log_softmax(-1)
        picked = expected.gather(1, torch.tensor(second.token_ids)[:, None])[:, 0]
        assert second.logprobs == pytest.approx(picked.tolist(), abs=1e-4)
        assert second.logprobs != pytest.approx(first.logprobs, abs=1e-3)
    finally:
        engine.stop()

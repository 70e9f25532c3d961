"""Chunked logprobs equal the plain full-logits computation, values and gradients."""

import torch

from art.training.logprobs import sequence_logprobs
from art.training.loss import token_logprobs


def test_chunked_logprobs_match_full_logits(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (3, 11))
    attention = torch.ones_like(ids)
    attention[2, 8:] = 0  # a right-padded row
    weights = torch.randn(3, 10)

    full = token_logprobs(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
    (full * weights).sum().backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    chunked = sequence_logprobs(model, ids, attention, chunk_tokens=7)  # chunks cross row boundaries
    (chunked * weights).sum().backward()
    assert chunked.shape == (3, 10)
    assert torch.allclose(chunked, full, atol=1e-5)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, full_grads[name], atol=1e-5), name

"""Chunked logprobs equal the plain full-logits computation, values and gradients."""

import torch

from art.training.logprobs import sequence_logprobs
from art.training.loss import token_logprobs


def test_chunked_logprobs_match_full_logits(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the adapter's init: the same numbers whichever tests ran before
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
    # The gradients sum the head's backward over the vocabulary in another order: float32 rounding
    # of about 1e-5 of each tensor's scale. Measured over 4 adapter seeds with AVX-512 and with the
    # generic ATen/MKL/oneDNN kernels: relative norm at most 1.2e-5, an element at most 1.6e-5 of
    # the tensor's largest (elements of up to 2.1; an absolute 1e-5 used up to 134% of itself).
    for name, p in model.named_parameters():
        if p.requires_grad:
            want, gap = full_grads[name], p.grad - full_grads[name]
            assert gap.norm() <= 2e-4 * want.norm() and gap.abs().max() <= 2e-4 * want.abs().max(), name

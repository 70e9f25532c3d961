"""What the backend must know of a model's architecture, read from its config and module tree.

Three questions, answered before or right after loading: can we serve and train it at all (a
model we cannot serve is refused at `register`, never a 500 in a rollout); which LoRA targets
suit it (mixture-of-experts models keep their experts in fused 3-D parameters that peft reaches
through `target_parameters`); does a layer keep a recurrent state (linear attention, Mamba,
short convolutions), which a packed training row would leak from one sequence into the next.
torch and transformers are imported on use.
"""

from __future__ import annotations

DOCS = "docs/models.md"
"""Where the supported architectures are listed (named in every refusal)."""

EXPERT_PARAMETERS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
"""The names transformers 5 gives a layer's fused expert weights ([experts, out, in] or
[experts, in, out]), e.g. Qwen3-MoE's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`."""


def expert_parameters(model) -> list[str]:
    """Names of the fused expert parameters of `model` (e.g. ["down_proj", "gate_up_proj"]): the
    3-D parameters of modules whose name ends in "experts". peft matches them as suffixes; the
    router (`mlp.gate`, `router`) never matches, so it stays frozen."""
    found = set()
    for module_name, module in model.named_modules():
        while module_name.endswith(".base_layer"):  # under peft's wrappers (a LoRA on them already)
            module_name = module_name.removesuffix(".base_layer")
        if not module_name.rsplit(".", 1)[-1].endswith("experts"):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 3 and name in EXPERT_PARAMETERS:
                found.add(name)
    return sorted(found)


def lora_targets(model, lora: dict) -> dict:
    """`lora` (peft LoraConfig arguments) made explicit where the model needs it. A mixture-of-
    experts model gets LoRA on its routed experts unless the caller chose `target_parameters`
    ([] turns it off), and `target_modules` (plain linear layers: attention, dense MLPs, shared
    experts) spelled as the full names of the layers they match: left as leaf names, peft 0.22
    reads "gate_proj" or "down_proj" the transformers-4 way on some families (Qwen2/3-MoE, OLMoE,
    GLM-4.5) and adds the fused experts whatever `target_parameters` says. A Mamba2 mixer's
    `out_proj` is never a target: its fused CUDA kernel reads the weight itself, past any LoRA
    (peft refuses it outright on Falcon-H1 and Nemotron-H)."""
    experts = expert_parameters(model)
    skipped = mamba_output_projections(model)
    if not experts and not skipped:
        return lora
    out = dict(lora)
    if experts:
        out.setdefault("target_parameters", experts)
    names = out.get("target_modules")
    if isinstance(names, (list, tuple, set)):
        out["target_modules"] = [n for n in _linear_layers(model, set(names)) if n not in skipped] or None
    return out


def mamba_output_projections(model) -> set[str]:
    """Full names of the Mamba2 mixers' output projections (a mixer: `A_log`, `D` and `out_proj`;
    Gated DeltaNet has no `D` and calls its `out_proj` as a layer)."""
    return {
        f"{name}.out_proj"
        for name, module in model.named_modules()
        if all(hasattr(module, a) for a in ("A_log", "D", "out_proj"))
    }


V4_EXPERT_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})
"""What an expert's projections were called before transformers 5 fused them."""


def _linear_layers(model, names: set[str]) -> list[str]:
    """The full names of the linear layers whose last part is in `names`. A name that matches no
    linear layer stays as given (peft then matches it, or says it matches nothing), unless it is
    an expert projection's old name: `target_parameters` decides the experts."""
    import torch

    found = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names]
    unmatched = names - {n.rsplit(".", 1)[-1] for n in found} - V4_EXPERT_NAMES
    return sorted(found) + sorted(unmatched)


def has_recurrent_layers(config) -> bool:
    """Whether some layer keeps a state that flows from token to token (Gated DeltaNet, Mamba,
    short convolutions): a row must then hold one sequence, and a prefix is more than its keys."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers)


def support_problem(config) -> str | None:
    """Why we cannot serve and train a model of this config (None: we can). Covers what fails
    only later otherwise: quantised checkpoints and cache layouts the engine cannot batch."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DummyLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionLayer,
    )

    model_type = getattr(config, "model_type", "?")
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:  # no quantised checkpoint is loaded: the trainer needs float weights
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        return (
            f"model_type {model_type!r} is quantised ({method}): the trainer needs float weights; "
            "use the unquantised checkpoint"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return f"model_type {model_type!r} has no causal language model in transformers (AutoModelForCausalLM)"
    served = (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionLayer,
        DummyLayer,
    )
    layers = DynamicCache(config=config).layers
    for index, layer in enumerate(layers):
        if type(layer) not in served:
            return (
                f"model_type {model_type!r}: layer {index} keeps a {type(layer).__name__} cache, "
                "which the engine cannot split into rows"
            )
    if not any(type(layer) in served[:3] for layer in layers):
        return (
            f"model_type {model_type!r} has only recurrent layers, no attention layer: the engine cannot serve it yet"
        )
    return None

"""The engine's own forward pass of Llama-family decoders, on the module tree transformers built.

Llama, Mistral, Qwen2 and Qwen3 share one block: RMSNorm -> attention with rotary positions
(grouped KV heads; Qwen2 biases, Qwen3 per-head q/k norms) -> RMSNorm -> gated MLP. This
module runs that block with its own attention over the engine's KV cache (`kv_cache.py`),
calling the model's own norms and reading its projection weights through `ServedWeights`, so
the weights are the ones the trainer trains, with no copy. Owning the attention is what lets a
step have static shapes: every row writes its keys at its own position and attends over a
fixed width under a mask, and a decode step can be replayed as a CUDA graph.

It does not know about requests, sampling or adapters' names. Architectures it does not cover
(`unsupported_reason`) are served through transformers' forward by `hf_runner.py`.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from art.engine.kv_cache import KVCache
from art.engine.served_weights import Route, ServedWeights
from art.weights import base_of

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SDPA_ENV = "ART_ENGINE_SDPA"
"""SDPA kernels the engine's attention may use, e.g. "efficient,flash,math" (unset: PyTorch's choice);
for measuring on a GPU which ones compute the step right and fastest (benchmarks/gpu_check.sh)."""
_SDPA_NAMES = {
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.act_fn",
)


def causal_lm_parts(model):
    """(the transformers CausalLM under any peft wrapper, its decoder trunk)."""
    base = base_of(model)
    return base, getattr(base, "model", None)


def unsupported_reason(model) -> str | None:
    """Why this engine's decoder cannot run `model` (None: it can)."""
    base, trunk = causal_lm_parts(model)
    config = base.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (the decoder covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if trunk is None or not all(hasattr(trunk, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    if not hasattr(base, "lm_head") or getattr(config, "final_logit_softcapping", None):
        return "an output head that is more than a projection"
    rope_type = getattr(trunk.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope_type {rope_type!r} (its frequencies depend on the sequence length)"
    for layer in trunk.layers:
        for part in _LAYER_PARTS:
            owner = layer
            for name in part.split("."):
                owner = getattr(owner, name, None)
            if owner is None:
                return f"a decoder layer without {part}"
    for module in model.modules():
        if (
            any(getattr(module, "use_dora", {}).values())
            or getattr(module, "lora_bias", {})
            and any(module.lora_bias.values())
        ):
            return "DoRA or LoRA bias adapters"
    # The decoder applies adapters per row to projections; peft wrappers elsewhere apply one adapter
    # to the whole batch (LoRA on embeddings or norms, modules_to_save).
    wrapped = [trunk.embed_tokens, trunk.norm, base.lm_head] + [
        m for layer in trunk.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if any(hasattr(m, "modules_to_save") or (m is not base.lm_head and hasattr(m, "lora_A")) for m in wrapped):
        return "adapters on embeddings, norms or modules_to_save"
    return None


class Decoder:
    def __init__(
        self,
        model,
        weights: ServedWeights,
        *,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        repeat_kv: bool | None = None,
    ) -> None:
        base, trunk = causal_lm_parts(model)
        self.config = config = base.config
        self.trunk, self.lm_head, self.weights = trunk, base.lm_head, weights
        self.layers = list(trunk.layers)
        attention = self.layers[0].self_attn
        self.q_heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.q_heads
        self.head_dim = attention.head_dim
        self.scale = attention.scaling
        self.qk_norm = hasattr(attention, "q_norm")
        self.windows = [_sliding_window(layer.self_attn, config) for layer in self.layers]
        self.device, self.dtype = device, dtype
        self.repeat_kv = device.type == "cuda" if repeat_kv is None else repeat_kv
        """Masked prefills repeat keys per query head (see `_attend`) instead of SDPA's GQA."""
        self.sdpa_backends = sdpa_backends(os.environ.get(SDPA_ENV, ""))
        # The residual stream stays in float32 over float32 master weights (full fine-tuning on
        # CUDA, served in bf16), as the trainer's autocast keeps it; only matmul inputs are cast.
        embedding = trunk.embed_tokens.weight.dtype
        self.residual_dtype = torch.float32 if embedding == torch.float32 else dtype
        # Rotary tables for every position, from the model's own rotary module (any static rope
        # scaling): row p is what the model computes at position p.
        positions = torch.arange(max_positions, device=device)[None]  # [1, positions]
        cos, sin = trunk.rotary_emb(torch.zeros(1, device=device, dtype=dtype), positions)
        self.cos, self.sin = cos[0], sin[0]  # [positions, head_dim]

    def projections(self) -> list:
        """Every module `weights.linear` multiplies by."""
        parts = (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
        return [layer.get_submodule(part) for layer in self.layers for part in parts] + [self.lm_head]

    def kv_cache(self, *, max_rows: int, max_tokens: int, growable: bool, capacity: int | None = None) -> KVCache:
        return KVCache(
            layers=len(self.layers),
            heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_rows=max_rows,
            max_tokens=max_tokens,
            growable=growable,
            capacity=capacity,
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        width: int,
        route: Route,
        last: torch.Tensor | None = None,
        after: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] (float32) after tokens `ids` [rows, tokens] at `positions` [rows, tokens].

        Row r is slot r of `cache`: its keys and values are written at its positions, and each
        token attends to the slot's positions up to its own within the first `width` (which must
        cover every position). `after`: every row's positions are after..after+tokens-1 and
        `width` is after+tokens (a prefill block behind `after` positions already in the cache,
        0 for a prompt with no cached prefix), so attention needs no mask and SDPA takes its
        causal kernels. `last` [rows] picks the token whose logits are returned (default: the
        last). Padding tokens may follow a row's real ones: they write past its end, where
        nothing reads before a later step overwrites them. `out`: the logits are written there.
        """
        rows, tokens = ids.shape
        x = self.trunk.embed_tokens(ids).to(self.residual_dtype)  # [rows, tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [rows, 1, tokens, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        masks: dict[int | None, torch.Tensor | None] = {}  # one additive mask per window, per forward
        slot = torch.arange(rows, device=ids.device)[:, None].expand(rows, tokens)  # [rows, tokens]
        for index, layer in enumerate(self.layers):
            window = self.windows[index]
            window = window if window is not None and window < width else None  # a window as wide is none
            if window not in masks:
                masks[window] = None if after is not None and window is None else self._mask(positions, width, window)
            x = self._layer(layer, index, x, cos, sin, cache, slot, positions, width, masks[window], after, route)
        if last is not None:
            x = x[torch.arange(rows, device=ids.device), last]  # [rows, hidden]
        else:
            x = x[:, -1]
        hidden = _norm(self.trunk.norm, x)
        logits = self.weights.linear(hidden, self.lm_head, route)
        return logits.float() if out is None else out.copy_(logits)  # [rows, vocab]

    def _layer(self, layer, index, x, cos, sin, cache, slot, positions, width, mask, after, route):
        rows, tokens, _ = x.shape
        attention, mlp, linear = layer.self_attn, layer.mlp, self.weights.linear
        h = _norm(layer.input_layernorm, x)
        q = linear(h, attention.q_proj, route).view(rows, tokens, self.q_heads, self.head_dim)
        k = linear(h, attention.k_proj, route).view(rows, tokens, self.kv_heads, self.head_dim)
        v = linear(h, attention.v_proj, route).view(rows, tokens, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = _norm(attention.q_norm, q).to(self.dtype), _norm(attention.k_norm, k).to(self.dtype)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [rows, heads, tokens, head_dim]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.k[index], cache.v[index]  # [slots, kv_heads, cache tokens, head_dim]
        keys[slot, :, positions] = k.transpose(1, 2).to(keys.dtype)  # [rows, tokens, kv_heads, head_dim]
        values[slot, :, positions] = v.to(values.dtype)
        out = self._attend(q, keys[:rows, :, :width], values[:rows, :, :width], mask, after)
        x = x + linear(out.transpose(1, 2).reshape(rows, tokens, -1), attention.o_proj, route)
        h = _norm(layer.post_attention_layernorm, x)
        gate = mlp.act_fn(linear(h, mlp.gate_proj, route)) * linear(h, mlp.up_proj, route)
        return x + linear(gate, mlp.down_proj, route)

    def _mask(self, positions: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
        """The additive mask [rows, 1, tokens, width] in the compute dtype: 0 where a token sees a
        position (its own and earlier ones, within the window), -inf elsewhere."""
        columns = torch.arange(width, device=positions.device)  # [width]
        visible = columns <= positions[:, :, None]  # [rows, tokens, width]
        if window is not None:
            visible &= columns > positions[:, :, None] - window
        zero = torch.zeros((), dtype=self.dtype, device=positions.device)
        return torch.where(visible, zero, float("-inf")).unsqueeze(1)

    def _attend(self, q, keys, values, mask, after=None):
        """q [rows, q_heads, tokens, dim] over keys/values [rows, kv_heads, width, dim] -> like q.

        - Causal (mask None) behind `after` cached positions: SDPA's causal kernels, which skip
          the masked half. Their alignment is top-left (query i sees keys up to i), so `after`
          zero queries go in front and their outputs are dropped: query after+i sees keys up
          to after+i, as it must. (The prefill chooses this only when `after` is small next to
          the block: those queries cost attention work.)
        - A decode step (one token): the query heads that share a KV head are laid out as extra
          query positions of that head, so every fused kernel reads each key once, and the
          mask [rows, 1, 1, width] broadcasts over them with no copy.
        - A masked prefill (a cached prefix, a window, a later block of a long prompt): the CPU's
          flash kernel takes grouped heads and the mask directly; on CUDA the keys are repeated
          per query head (one layer's worth), so the masked kernel is the memory-efficient one
          rather than SDPA's math fallback, whose memory grows with tokens x width.
        """
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else nullcontext():
            return self._sdpa(q, keys, values, mask, after)

    def _sdpa(self, q, keys, values, mask, after):
        rows, heads, tokens, dim = q.shape
        grouped = self.kv_heads != heads
        if mask is not None and tokens == 1:
            out = F.scaled_dot_product_attention(
                q.reshape(rows, self.kv_heads, -1, dim), keys, values, attn_mask=mask, scale=self.scale
            )
            return out.reshape(rows, heads, tokens, dim)
        if grouped and self.repeat_kv:  # expand, not repeat_interleave: no host sync
            shape = (rows, self.kv_heads, heads // self.kv_heads, *keys.shape[2:])
            keys = keys[:, :, None].expand(shape).reshape(rows, heads, *keys.shape[2:])
            values = values[:, :, None].expand(shape).reshape(rows, heads, *values.shape[2:])
            grouped = False
        if mask is None and after:
            q = torch.cat([q.new_zeros(rows, heads, after, dim), q], dim=2)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=grouped
        )
        return out[:, :, after:] if mask is None and after else out


def sdpa_backends(names: str) -> list[SDPBackend] | None:
    """The kernels a comma-separated list names ("" or "default": None, PyTorch's choice)."""
    chosen = [n.strip().lower() for n in names.split(",") if n.strip()]
    if not chosen or chosen == ["default"]:
        return None
    unknown = [n for n in chosen if n not in _SDPA_NAMES]
    if unknown:
        raise ValueError(f"{SDPA_ENV}: unknown SDPA kernel {unknown[0]!r} (choose from {', '.join(_SDPA_NAMES)})")
    return [_SDPA_NAMES[n] for n in chosen]


_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one fused op where its class is one whose math is known (an upcast
    to float32, x / rms, back to the input dtype, times the weight); other norms are called."""
    if type(module).__name__ not in _RMS_NORMS:
        return module(x)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=module.variance_epsilon)
    return module.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _sliding_window(attention, config) -> int | None:
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window or None
    return getattr(config, "sliding_window", None) if config.model_type == "mistral" else None

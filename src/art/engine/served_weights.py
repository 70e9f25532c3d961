"""What each projection of the engine's forward pass multiplies by, on weights shared with the trainer.

The engine reads the module tree the trainer trains (peft LoRA layers or plain `nn.Linear`),
so the base weights exist once. Per projection it may keep a prepared copy, built lazily:
- under `merge`, W + B A s of the live adapter, for batches that only use it (the LoRA then
  costs nothing), rebuilt after each weight update;
- on the CPU, weights packed for oneDNN's matmul (1.4-2.3x `F.linear` at decode batch sizes on
  an AVX2 CPU, `benchmarks/results/2026-12-01-cpu_decode_step.md`);
- in the serving dtype when the stored one differs (fp32 master weights under full fine-tuning
  on CUDA are served in bf16).
Without any of these the module's own weight is used, with no copy. Rows that use another
adapter (`name@step`) or none (the base model) add their own LoRA on top of the base weights.

The live adapter is never read where the trainer writes it: its LoRA factors are copied
(`_live`, a few MB) when a weight update is published, and every live row multiplies by those
copies or by the merged weights built from them. So a training step may run beside the engine
(`LLMEngine.serving_while_training`): the engine serves the last published step until the next
is published. Rows still decoding on an earlier publication keep its copies under a retired
name (`retire`) until they finish, so a request ends on the weights it started with.

Prepared tensors are refreshed in place when they can be, so a CUDA graph captured against
them stays valid across weight updates. Callers hold the model lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from art.engine.adapters import BASE, LIVE
from art.weights import is_peft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Which weights one forward pass uses."""

    merged: bool = False
    """Every row uses the live adapter (or a model without adapters): prepared live weights."""
    adapter: str | None = None
    """Every row uses this peft adapter on top of the base weights (None: the base alone)."""
    groups: tuple[tuple[str, torch.Tensor], ...] = ()
    """A mixed batch: (adapter, row indices [k]) per adapter; other rows use the base alone."""

    @property
    def key(self) -> str | None:
        """A name for what a CUDA graph may be captured against (None: keep this batch eager)."""
        if self.groups:
            return None
        if self.merged:
            return "merged"
        return "base" if self.adapter is None else ("live" if self.adapter == LIVE else None)


class ServedWeights:
    def __init__(self, model, *, dtype: torch.dtype, merge: bool, pack: bool) -> None:
        self.model = model
        self.peft = is_peft(model)
        self.dtype = dtype
        self.merge = merge and self.peft
        self.pack = pack and dtype == torch.float32 and _packing_works()
        self._prepared: dict[tuple[int, str], tuple[torch.Tensor, object]] = {}  # -> (tensor, module)
        self._stale: set[tuple[int, str]] = set()
        self._live: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id(module) -> copies of its live LoRA (A [r, in], B [out, r]) as last published."""
        self._live_dtype = None if self.merge else dtype
        """The copies' dtype: the serving dtype when decode steps multiply by them (a bf16 step
        then needs no cast around its LoRA matmuls); the trainer's (float32) when they only
        build the merged weights, which are then rounded once."""
        self._live_stale = True
        self._retired: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        """A retired name ("default@3") -> the live copies of that publication, while rows use them."""

    def route(self, adapter_names: list[str], device: torch.device) -> Route:
        unique = set(adapter_names)
        if not self.peft or (self.merge and unique == {LIVE}):
            return Route(merged=True)
        if len(unique) == 1:
            name = unique.pop()
            return Route(adapter=None if name == BASE else name)
        groups = tuple(
            (name, torch.tensor([i for i, n in enumerate(adapter_names) if n == name], device=device))
            for name in sorted(unique - {BASE})
        )
        return Route(groups=groups)

    def linear(self, x: torch.Tensor, module, route: Route) -> torch.Tensor:
        """`module`'s output for `x` [..., in] under `route`: [..., out]."""
        lora = hasattr(module, "lora_A")
        base = module.get_base_layer() if lora else module
        merged = route.merged and lora and LIVE in module.lora_A
        y = self._matmul(x, self._weight(module, "merged" if merged else "base"), base.bias)
        if lora and not route.merged:
            if route.adapter is not None and (factors := self._factors(module, route.adapter, y.dtype)) is not None:
                y = _add_lora(y, x, *factors)
            for name, rows in route.groups:
                if (factors := self._factors(module, name, y.dtype)) is not None:
                    a, b, scaling = factors
                    y = y.index_add(0, rows, F.linear(F.linear(x[rows].to(a.dtype), a), b), alpha=scaling)
        return y

    def _factors(self, module, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(A, B, scaling) of adapter `name` in `module`, in `dtype`: the published copies for the
        live adapter and retired publications (already in `dtype` unless they only feed the
        merged weights), peft's own tensors for checkpoints (cast where they differ: eager
        batches only); None when the module has no such adapter."""
        if name == LIVE or name in self._retired:
            copies = (self._live if name == LIVE else self._retired[name]).get(id(module))
            if copies is None:
                return None
            (a, b), scaling = copies, module.scaling[LIVE]
        elif name in module.lora_A:
            a, b, scaling = module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]
        else:
            return None
        return a.to(dtype), b.to(dtype), scaling

    def copy_bytes(self, modules) -> int:
        """Bytes of the copies `linear` will prepare for these modules (a CUDA engine's memory
        budget counts them before they exist)."""
        total = 0
        for module in modules:
            lora = hasattr(module, "lora_A")
            weight = (module.get_base_layer() if lora else module).weight
            size = weight.numel() * self.dtype.itemsize
            total += size if self.merge and lora and LIVE in module.lora_A else 0  # the merged variant
            total += size if self.pack or weight.dtype != self.dtype else 0  # the base variant
            if lora and LIVE in module.lora_A:  # the published copy of the live LoRA factors
                total += sum(
                    p.numel() * (self._live_dtype or p.dtype).itemsize
                    for p in (module.lora_A[LIVE].weight, module.lora_B[LIVE].weight)
                )
        return total

    def weights_changed(self, *, all_weights: bool, retire: str | None = None) -> None:
        """The live adapter (or, `all_weights`, every weight: full fine-tuning) changed.
        `retire`: rows still decode on the publication being replaced; keep its live copies
        under this name (`forget` drops them once no row uses it)."""
        if retire is not None:
            if not self.peft:
                raise RuntimeError("only a LoRA adapter's earlier weights can keep serving beside new ones")
            with torch.inference_mode():
                self._retired[retire] = {key: (a.clone(), b.clone()) for key, (a, b) in self._live.items()}
        self._live_stale = True
        self._stale.update(k for k in self._prepared if all_weights or k[1] == "merged")

    def refresh(self) -> None:
        """Rebuild what a weight update made stale, now (a replayed CUDA graph runs no Python).
        The live copies first: the merged weights are built from them. (Under inference mode
        wherever it is called from: the engine's tensors are inference tensors.)"""
        with torch.inference_mode():
            if self._live_stale:
                self._copy_live()
            for key in list(self._stale):
                _, module = self._prepared[key]
                self._weight(module, key[1])

    def retired(self) -> set[str]:
        return set(self._retired)

    def forget(self, name: str) -> None:
        """No row decodes on retired publication `name` any more."""
        self._retired.pop(name, None)

    def _copy_live(self) -> None:
        """Copy the live LoRA factors the trainer wrote (in `_live_dtype`), in place, so CUDA
        graphs keep reading them."""
        if self.peft:
            for module in self.model.modules():
                if hasattr(module, "lora_A") and LIVE in module.lora_A:
                    a, b = module.lora_A[LIVE].weight.detach(), module.lora_B[LIVE].weight.detach()
                    copies = self._live.get(id(module))
                    if copies is not None and copies[0].shape == a.shape and copies[1].shape == b.shape:
                        copies[0].copy_(a)
                        copies[1].copy_(b)
                    else:
                        dtype = self._live_dtype or a.dtype
                        self._live[id(module)] = (a.to(dtype, copy=True), b.to(dtype, copy=True))
        self._live_stale = False

    def _weight(self, module, variant: str) -> torch.Tensor:
        key = (id(module), variant)
        cached, _ = self._prepared.get(key, (None, None))
        if cached is not None and key not in self._stale:
            return cached
        weight = (module.get_base_layer() if hasattr(module, "lora_A") else module).weight.detach()
        if variant == "merged":
            if self._live_stale:
                self._copy_live()
            a, b = self._live[id(module)]  # as peft's get_delta_weight: (B @ A) * scaling
            weight = weight + ((b @ a) * module.scaling[LIVE]).to(weight.dtype)
        if not self.pack and variant == "base" and weight.dtype == self.dtype:
            return weight  # the module's own tensor: no copy
        self._stale.discard(key)
        if self.pack:
            prepared = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), _PACK_BATCH_HINT)
        elif cached is not None and cached.shape == weight.shape:
            prepared = cached.copy_(weight)  # in place: CUDA graphs hold this address
        else:
            prepared = weight.to(self.dtype, copy=True)
        self._prepared[key] = (prepared, module)
        return prepared

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A float32 norm's output (and bias), when float32 master weights are served in bf16.
        x = x.to(weight.dtype)
        bias = None if bias is None else bias.to(weight.dtype)
        if not self.pack:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


def _add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """y += s * (x A^T) B^T as two matmuls, the second accumulating into y in place (`addmm_`,
    a GEMM with beta=1: out of place it would copy y first): no scale, add or cast kernels of
    their own (a CUDA decode step runs this in every adapted projection of every layer). a [r, in]
    and b [out, r] in y's dtype; y is the fresh output of the base matmul."""
    hidden = F.linear(x.to(a.dtype), a)  # [..., r]
    y.view(-1, y.shape[-1]).addmm_(hidden.view(-1, hidden.shape[-1]), b.t(), alpha=scaling)
    return y


_PACK_BATCH_HINT = 32
"""oneDNN picks its packed layout for this many rows; any row count works."""
_packing: bool | None = None


def _packing_works() -> bool:
    """oneDNN's packed linear exists in x86 CPU builds of torch; check once that it runs and agrees."""
    global _packing
    if _packing is None:
        try:
            w, x = torch.randn(8, 16), torch.randn(3, 16)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            _packing = bool(torch.allclose(out, F.linear(x, w), atol=1e-4))
        except (RuntimeError, AttributeError, NotImplementedError) as exc:
            log.info("oneDNN packed linear unavailable (%s); the engine uses F.linear", exc)
            _packing = False
    return _packing

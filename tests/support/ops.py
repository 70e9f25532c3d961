"""Counting the ops a piece of tensor code runs, on the CPU profiler: a proxy for the kernels a GPU
would launch (each leaf aten op is one kernel or none). Shared by tests and benchmarks/decode_ops.py."""

from __future__ import annotations

import collections

NO_KERNEL_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
    "aten::as_strided", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::alias", "aten::detach", "aten::empty", "aten::empty_strided", "aten::resolve_conj",
    "aten::resolve_neg", "aten::lift_fresh", "aten::split", "aten::chunk", "aten::narrow", "aten::item",
    "aten::_local_scalar_dense", "aten::unbind", "aten::numpy_T", "aten::view_as", "aten::to",
    "aten::contiguous", "aten::clone", "aten::_to_copy", "aten::type_as",
})
"""Ops that change a tensor's metadata or allocate without computing, or only call ops that do
(a cast is its `copy_`, counted there): no kernel of their own."""
MATMUL_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "matmul", "linear", "mkldnn_linear", "_linear_pointwise"})


def leaf_ops(run) -> collections.Counter:
    """Name -> count of the leaf ops (computing ops with no computing op inside) that `run()` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()

    def computes(event) -> bool:
        return event.name.startswith(("aten::", "mkldnn::")) and event.name not in NO_KERNEL_OPS

    def computes_inside(event) -> bool:
        return any(computes(child) or computes_inside(child) for child in event.cpu_children)

    return collections.Counter(e.name for e in prof.events() if computes(e) and not computes_inside(e))


def matmuls(counts: collections.Counter) -> int:
    return sum(n for name, n in counts.items() if name.split("::", 1)[1] in MATMUL_OPS)

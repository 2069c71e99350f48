"""Linear layers with their weights pre-packed for oneDNN: the CPU's matmuls without re-packing.

``F.linear`` on a CPU hands each call to a BLAS GEMM that packs the weight matrix into its
own blocked layout before it multiplies, every call. A batch of a few rows (a step of
decodes) then spends most of its time packing: on two cores a 16-row step through the
``small`` model's 3072x512 gate/up projection takes 2.1 ms, 0.9 ms with the weight packed
once; a 290-row prefill chunk 15.6 ms against 12.6 ms. In bfloat16 on a CPU with native
bfloat16 dot products (AVX512-BF16, AMX) the packed matmuls run at about twice float32's
speed (one thread, a 297x512 by 512x3072 product: 4.2 ms against 8.4 ms; 16 rows 0.25 ms
against 0.46 ms). Inference never changes a weight, so each ``nn.Linear`` of a part is
replaced, once its weights are loaded, by a ``PackedLinear`` that holds only the packed
copy (the plain one is freed) and runs oneDNN's matmul on it. The packed layout serves any
number of rows.

This is the CPU seam: ``pack_linears`` does nothing on CUDA, for dtypes other than
float32 and bfloat16 (bfloat16 only where oneDNN has bfloat16 kernels for the CPU), or
where torch was built without oneDNN (``packing_supported``).
Setting ``HYDRAD_CPU_PACKED_LINEAR=0`` in the environment turns it off (the results are the same
up to float rounding; the switch is there to compare and to rule it out).
"""

from __future__ import annotations

import os

import torch
from torch import nn

# Rows the packed layout is tuned for; any number of rows is served (a hint to oneDNN only).
_ROWS_HINT = 16
ENV_SWITCH = "HYDRAD_CPU_PACKED_LINEAR"


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` packs weights of ``dtype`` on ``device``."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    # oneDNN's bfloat16 kernels need AVX-512 (or Arm's bfloat16); elsewhere the plain layers run
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """An ``nn.Linear`` for inference whose weight is held only in oneDNN's packed layout.

    ``weight`` is a meta tensor of the original shape and dtype, so code that reads a
    layer's dtype or shape still can; any arithmetic on it fails loudly.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT),
                             persistent=False)
        bias = linear.bias
        self.register_buffer("bias", bias.detach() if bias is not None else None, persistent=False)
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(parent: nn.Module, names: list[str], device: torch.device | str, dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` in the children ``names`` of ``parent`` (their weights
    loaded; a child may itself be a linear layer) by a ``PackedLinear`` where
    ``packing_supported``; returns how many were replaced."""
    if not packing_supported(device, dtype):
        return 0
    found = []
    for top in names:
        child = getattr(parent, top)
        slots = [(parent, top, child)] + [(owner, name, layer) for owner in child.modules()
                                          for name, layer in owner.named_children()]
        found += [(owner, name, layer) for owner, name, layer in slots if isinstance(layer, nn.Linear)
                  and layer.weight.dtype == dtype and layer.weight.device.type == "cpu"]
    with torch.no_grad():
        for owner, name, layer in found:
            setattr(owner, name, PackedLinear(layer))
    return len(found)


__all__ = ["ENV_SWITCH", "PackedLinear", "pack_linears", "packing_supported"]

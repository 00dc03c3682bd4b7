"""Inference-time weight prepacking for CPU matmuls.

PyTorch's default CPU GEMM is fast for one row (a GEMV) but 2-3x slower for 2-16 rows, exactly
the shapes speculative verification produces (fp32 LM head on an AVX2 EPYC: 13.2 ms for 1 row,
29.8 ms for 4). oneDNN with weights reordered once ("prepacked") runs them in about the time of
one (8.5 vs 9.8 ms), so verifying gamma draft tokens costs about as much as decoding one. fp32
packs on any CPU; bf16 only where oneDNN has bf16 kernels. Training keeps ordinary nn.Linear
layers (autograd needs them).
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available(dtype: torch.dtype) -> bool:
    """fp32 packs wherever oneDNN is built in; bf16 only where the CPU has the instructions it needs."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """A frozen nn.Linear whose weight oneDNN has reordered for its own kernels."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept for readers (tied embeddings, trainers); not used to compute
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(module: nn.Module, batch_hint: int = 64) -> nn.Module:
    """Replace every CPU nn.Linear in `module` (in place) by a PackedLinear where oneDNN packs its dtype."""
    for name, child in list(module.named_children()):
        if (
            isinstance(child, nn.Linear)
            and child.weight.device.type == "cpu"
            and packing_available(child.weight.dtype)
        ):
            setattr(module, name, PackedLinear(child, batch_hint))
        else:
            pack_linears(child, batch_hint)
    return module

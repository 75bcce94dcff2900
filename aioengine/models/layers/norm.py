"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 as HF transformers does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. ``x``: ``[..., dim]``; ``weight``: ``[dim]``.

    In fp32 this is torch's fused ``rms_norm`` (bit-identical to HF's three-op form);
    other dtypes normalise in fp32 and cast back before the weight, exactly as HF's
    ``LlamaRMSNorm``. Gemma's ``(1 + weight)`` form is this with the offset added to
    the weight once at load (``gemma.py``), which in fp32 is the same arithmetic.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)

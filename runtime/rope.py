"""Rotary position embedding (Su et al. 2021) as the runtime's attention applies it: the
inverse frequencies of a model (with Llama 3.1's scaling) and their rotation of queries and keys."""
from __future__ import annotations

import math

import torch

from costmodel.specs import ModelSpec


def rope_frequencies(model: ModelSpec) -> torch.Tensor:
    """RoPE's per-pair inverse frequencies, base `rope_theta`; with Llama 3.1's scaling the long
    wavelengths (beyond original context / low_freq_factor) are divided by the factor, the short
    ones (below original context / high_freq_factor) kept, and those between interpolated."""
    dim = model.rotary_dims
    # on the CPU explicitly: the model is built under `torch.device("meta")`
    inv_freq = 1.0 / model.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    factor = model.rope_scaling_factor
    if factor == 1.0:
        return inv_freq
    context, low, high = model.rope_original_max_positions, model.rope_low_freq_factor, model.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength > context / low, inv_freq / factor,
                       torch.where(wavelength < context / high, inv_freq, scaled))


def rope(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) on (batch, seq, heads, head_dim), rotate-half form, at
    `positions` in the whole sequence (default 0, 1, ...; context parallelism holds others)."""
    seq, dim = x.shape[1], x.shape[-1]
    inv_freq = inv_freq.to(x.device)
    pos = torch.arange(seq, device=x.device) if positions is None else positions.to(x.device)
    angles = torch.outer(pos.float(), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[None, :, None, :].to(x.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1)[None, :, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin

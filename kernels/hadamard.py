"""The normalized Sylvester-Hadamard rotation ``int4`` applies along head_size.

H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]], H = H_D / sqrt(D): symmetric and orthogonal, so
H = H^T = H^-1 (H @ H = I). A rotation keeps dot products (q.k = (qH).(kH)) and spreads an outlier
channel over every channel, which shrinks the per-group range the 4-bit codes must cover.

``int4`` stores K H and V H; attention computes scores as (qH).(kH) and the output as
(sum_j p_j v_j H) H. The rotations run as fp32 torch matmuls in the Python wrappers (one launch
each, no host sync: CUDA-graph safe); this module is the single place that computes them, shared by
the kernels' wrappers and the torch references so both see the same rotated values bit for bit.
"""

from __future__ import annotations

import torch

_CACHE: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
# Off only for the accuracy ablation "4-bit without rotation": set_rotation(False).
_ENABLED = True


def set_rotation(enabled: bool) -> None:
    """Turn the rotation into the identity (``False``) or back on, for the whole process.

    An ablation switch: pages written with one setting must be read with the same one.
    """
    global _ENABLED
    _ENABLED = bool(enabled)


def hadamard(d: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The normalized D x D Hadamard matrix, cached per (D, device, dtype). Do not modify it.

    Built with device ops only (no host-to-device copy), so even a first call inside CUDA-graph
    capture is legal; callers that capture graphs should still make it once beforehand so the
    cached matrix does not live in a graph's memory pool. Entries are +-fp(1/sqrt(D)) exactly.
    """
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size, got {d}")
    device = torch.device(device)
    key = (d, device, dtype)
    h = _CACHE.get(key)
    if h is None:
        h = torch.ones(1, 1, dtype=dtype, device=device)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = _CACHE[key] = h * d**-0.5  # +-1 times a constant: the same rounding everywhere
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last dim, computed and returned in fp32 (contiguous, a new tensor).

    Also undoes a rotation (H is its own inverse). Any input dtype; a row with NaN/Inf, or whose
    rotation overflows fp32 (|x| > ~3e37), comes out with non-finite elements.
    """
    if not _ENABLED:
        return x.to(torch.float32, copy=True).contiguous()
    h = hadamard(x.shape[-1], x.device)
    return torch.matmul(x.float(), h)

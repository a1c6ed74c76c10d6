"""The catalogue of KV-cache dtypes this project adds to vLLM.

One place that says, for each dtype name a user can pass to ``--kv-cache-dtype``, how many bits a
K/V element takes, what kind of scale it carries and how many bytes one (token, kv-head) costs.
Both the vLLM glue (``int8kv_shim``: page sizes, CLI choices, backend selection) and the kernels
(page layout, offsets) read it, so the two can never disagree about a page.

Pure Python on purpose: importing it must not import torch, triton or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScaleKind = Literal["per_token_head", "static_per_head", "per_group"]

# fp16 scales (and zero points) are 2 bytes; an fp16 scale is exact enough for absmax/127 of
# bf16/fp16 activations (relative error 2^-11, far below the int8 step of 1/127).
SCALE_BYTES = 2


@dataclass(frozen=True)
class KVCacheDtype:
    """One quantized KV-cache format."""

    name: str
    bits: int  # bits per stored K/V element
    scale_kind: ScaleKind
    description: str
    # Elements sharing one (scale, zero) pair for per-group formats; None: one group per head.
    group_size: int | None = None
    # True when a zero point is stored next to each scale (asymmetric quantization).
    has_zero_point: bool = False
    # Head sizes the kernels support for this dtype.
    head_sizes: tuple[int, ...] = (64, 128, 256)

    def data_bytes(self, head_size: int) -> int:
        """Bytes of quantized K (or V) data for one (token, kv-head)."""
        bits = head_size * self.bits
        if bits % 8:
            raise ValueError(f"{self.name}: head_size {head_size} does not fill whole bytes")
        return bits // 8

    def scale_bytes(self, head_size: int) -> int:
        """Bytes of per-token scale metadata for one (token, kv-head), K (or V) alone."""
        if self.scale_kind == "static_per_head":
            return 0
        groups = 1 if self.group_size is None else head_size // self.group_size
        return groups * SCALE_BYTES * (2 if self.has_zero_point else 1)

    def bytes_per_token_head(self, head_size: int) -> int:
        """Bytes one (token, kv-head) costs in the page, K and V together."""
        return 2 * (self.data_bytes(head_size) + self.scale_bytes(head_size))

    def page_bytes(self, block_size: int, num_kv_heads: int, head_size: int) -> int:
        """Bytes of one page (block) of one layer: every token's whole state."""
        return block_size * num_kv_heads * self.bytes_per_token_head(head_size)

    def capacity_vs_bf16(self, head_size: int) -> float:
        """How many more tokens fit than with a BF16 cache (2 bytes per element, K and V)."""
        return (2 * 2 * head_size) / self.bytes_per_token_head(head_size)


CATALOGUE: dict[str, KVCacheDtype] = {
    d.name: d
    for d in (
        KVCacheDtype(
            name="int8",
            bits=8,
            scale_kind="per_token_head",
            description="INT8, symmetric, dynamic fp16 scale per (token, kv-head); calibration-free",
        ),
        KVCacheDtype(
            name="int8_static",
            bits=8,
            scale_kind="static_per_head",
            description="INT8 with per-layer, per-kv-head scales from a calibration file",
        ),
        KVCacheDtype(
            name="int4",
            bits=4,
            scale_kind="per_group",
            group_size=64,
            has_zero_point=True,
            description="4-bit, Hadamard-rotated, asymmetric fp16 scale/zero per group",
        ),
    )
}

DTYPE_NAMES: tuple[str, ...] = tuple(CATALOGUE)


def get_dtype(name: str) -> KVCacheDtype:
    """The catalogue entry for ``name``; a clear error for anything else."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ValueError(
            f"unknown int8kv-shim KV-cache dtype {name!r}; known: {', '.join(DTYPE_NAMES)}"
        ) from None

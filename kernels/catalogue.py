"""The catalogue of KV-cache dtypes this project adds to vLLM.

One place that says, for each dtype name a user can pass to ``--kv-cache-dtype``, how many bits a
K/V element takes, what kind of scale it carries, how many bytes one (token, kv-head) costs, which
V storage formats it takes and which code paths serve it. Every list of dtype names the shim, the
kernels and the benchmarks use is derived here from the entries' fields (``KERNEL_DTYPES``,
``INT8_DTYPES``, ``STATIC_DTYPE``, ...), so the vLLM glue (``int8kv_shim``: page sizes, CLI
choices, backend selection) and the kernels (page layout, offsets) can never disagree.

Pure Python on purpose: importing it must not import torch, triton or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# per_channel_page: K has one (scale, zero) per (page, kv-head, channel), shared by the page's
# ``page_tokens`` tokens; V one per (token, kv-head, group of ``group_size`` channels).
ScaleKind = Literal["per_token_head", "static_per_channel", "per_group", "per_channel_page"]

# fp16 scales (and zero points) are 2 bytes; an fp16 scale is exact enough for absmax/127 of
# bf16/fp16 activations (relative error 2^-11, far below the int8 step of 1/127).
SCALE_BYTES = 2

# Symmetric int8 codes span [-127, 127] (-128 is never produced, so negation stays in range).
INT8_QMAX = 127.0


@dataclass(frozen=True)
class VFormat:
    """How the V elements of an int8-layout page are stored (the kernels' ``v_format`` keyword)."""

    name: str
    # Largest magnitude a stored element represents: a static V scale maps the calibration
    # statistic onto it (``int8kv_shim.static.file``).
    qmax: float
    description: str


V_FORMAT_CATALOGUE: dict[str, VFormat] = {
    f.name: f
    for f in (
        VFormat(name="int8", qmax=INT8_QMAX, description="int8 integers, like K"),
        # FP8-E4M3FN's largest finite value is 448 (kernels/e4m3.py)
        VFormat(name="e4m3", qmax=448.0, description="FP8-E4M3FN codes, decoded in software"),
    )
}

V_FORMATS: tuple[str, ...] = tuple(V_FORMAT_CATALOGUE)
# What every dtype stores V as unless told otherwise.
DEFAULT_V_FORMAT = "int8"


@dataclass(frozen=True)
class KVCacheDtype:
    """One quantized KV-cache format."""

    name: str
    bits: int  # bits per stored K/V element
    scale_kind: ScaleKind
    description: str
    # Elements sharing one (scale, zero) pair for per-group formats; None: one group per head.
    group_size: int | None = None
    # Head sizes up to this one keep one group per head (``group_for``); None: ``group_size``
    # applies at every head size.
    grouped_above: int | None = None
    # True when a zero point is stored next to each scale (asymmetric quantization).
    has_zero_point: bool = False
    # Head sizes the kernels support for this dtype.
    head_sizes: tuple[int, ...] = (64, 128, 256)
    # Largest stored code: int8 codes are -qmax..qmax, int4 codes 0..qmax (asymmetric, with a zero).
    qmax: float = INT8_QMAX
    # V storage formats (``V_FORMAT_CATALOGUE``) this dtype's pages can hold.
    v_formats: tuple[str, ...] = (DEFAULT_V_FORMAT,)
    # False: the name is registered with vLLM (so it parses) but refused at start-up, no kernels.
    has_kernels: bool = True
    # Served with a warning at start-up: slower than BF16 and far less accurate than int8.
    experimental: bool = False
    # Tokens of a page (vLLM block), fixed by the format; None: any block size.
    page_tokens: int | None = None
    # The newest, not yet full page of every sequence lives in the model's dtype in a tail pool the
    # vLLM glue owns; the write kernel quantizes a page into the cache when it fills.
    tail: bool = False
    # gather_kv_context dequantizes these pages (and, for int4, reads the tail and sink pages)
    # into BF16 K/V, so a chunked-prefill continuation can attend on FlashAttention over its
    # cached context (int8kv_shim/flash_prefill.py).
    context_gather: bool = False

    def data_bytes(self, head_size: int) -> int:
        """Bytes of quantized K (or V) data for one (token, kv-head)."""
        bits = head_size * self.bits
        if bits % 8:
            raise ValueError(f"{self.name}: head_size {head_size} does not fill whole bytes")
        return bits // 8

    def group_for(self, head_size: int) -> int:
        """Channels sharing one (scale, zero) pair of a token's V (or K and V for per_group and
        int8's per_token_head): the whole head without ``group_size`` or up to ``grouped_above``."""
        if self.group_size is None or (
            self.grouped_above is not None and head_size <= self.grouped_above
        ):
            return head_size
        return min(self.group_size, head_size)

    def scale_bytes(self, head_size: int) -> int:
        """Bytes of per-token scale metadata for one (token, kv-head), V alone (K too, but for
        per_channel_page: ``k_scale_bytes``)."""
        if self.scale_kind == "static_per_channel":
            return 0
        groups = head_size // self.group_for(head_size)
        return groups * SCALE_BYTES * (2 if self.has_zero_point else 1)

    def k_scale_bytes(self, head_size: int) -> int:
        """Bytes of K scale metadata per (token, kv-head): per_channel_page amortizes a page's
        per-channel (scale, zero) pairs over its ``page_tokens`` tokens."""
        if self.scale_kind != "per_channel_page":
            return self.scale_bytes(head_size)
        assert self.page_tokens is not None
        per_page = head_size * SCALE_BYTES * (2 if self.has_zero_point else 1)
        if per_page % self.page_tokens:
            raise ValueError(f"{self.name}: head_size {head_size} gives no whole bytes per token")
        return per_page // self.page_tokens

    def bytes_per_token_head(self, head_size: int) -> int:
        """Bytes one (token, kv-head) costs in the page, K and V together."""
        data = 2 * self.data_bytes(head_size)
        return data + self.k_scale_bytes(head_size) + self.scale_bytes(head_size)

    def page_bytes(self, block_size: int, num_kv_heads: int, head_size: int) -> int:
        """Bytes of one page (block) of one layer: every token's whole state. A dtype with
        ``page_tokens`` has a layout only at that block size (kernels/page_layout.py refuses the
        others); the product is still defined for the vLLM glue's size arithmetic."""
        return block_size * num_kv_heads * self.bytes_per_token_head(head_size)

    def capacity_vs_bf16(self, head_size: int) -> float:
        """How many more tokens fit than with a BF16 cache (2 bytes per element, K and V)."""
        return (2 * 2 * head_size) / self.bytes_per_token_head(head_size)

    def tail_slot_bytes(self, num_kv_heads: int, head_size: int, elem_bytes: int = 2) -> int:
        """Bytes one tail slot costs one layer: a page of K and V in the model's dtype
        (``elem_bytes`` per element) and the int32 block id it holds; 0 without a tail."""
        if not self.tail:
            return 0
        assert self.page_tokens is not None
        return 2 * num_kv_heads * self.page_tokens * head_size * elem_bytes + 4

    def tail_pool_bytes(
        self,
        layers: int,
        num_kv_heads: int,
        head_size: int,
        num_slots: int,
        elem_bytes: int = 2,
        pages_per_slot: int = 1,
    ) -> int:
        """Bytes of the tail pool: ``num_slots`` slots (vLLM's ``max_num_seqs``) in each of
        ``layers`` layers, each slot ``pages_per_slot`` BF16 pages (a second tail page, a sink
        page)."""
        slot = self.tail_slot_bytes(num_kv_heads, head_size, elem_bytes)
        return pages_per_slot * layers * num_slots * slot

    def tokens_with_tail(
        self,
        kv_bytes: int,
        layers: int,
        num_kv_heads: int,
        head_size: int,
        num_slots: int,
        elem_bytes: int = 2,
        pages_per_slot: int = 1,
    ) -> int:
        """Tokens of this dtype's cache in ``kv_bytes`` of memory once the tail pool
        (``tail_pool_bytes``) has taken its share of it: vLLM sizes the cache from what the
        model, the pool included, left."""
        pool = self.tail_pool_bytes(
            layers, num_kv_heads, head_size, num_slots, elem_bytes, pages_per_slot
        )
        per_token = layers * num_kv_heads * self.bytes_per_token_head(head_size)
        return max(kv_bytes - pool, 0) // per_token


CATALOGUE: dict[str, KVCacheDtype] = {
    d.name: d
    for d in (
        KVCacheDtype(
            name="int8",
            bits=8,
            scale_kind="per_token_head",
            # 64 channels per scale above head size 128: on Gemma 3 (head size 256) one scale per
            # head cost +0.51% perplexity through the cache, one per 64 channels +0.14% at 1.94x
            # BF16's capacity (benchmarks/results/accuracy_gemma3*.json), and the grouped decode
            # kernel measured faster there too. At head size 128 it measured slower than one scale
            # per head (the int8_g64 rows of benchmarks/results/kernels_int4.json against
            # kernels.json), with no accuracy gain measured, so head sizes <= 128 keep one scale
            # per (token, kv-head) and its kernels.
            group_size=64,
            grouped_above=128,
            description="INT8, symmetric, dynamic fp16 scale per (token, kv-head), per 64 channels "
            "above head size 128; calibration-free",
            context_gather=True,
        ),
        # One static scale per (layer, kv-head, channel): K's outlier channels no longer set
        # every channel's step. Simulated on Gemma 3 (head size 256, scales calibrated on the
        # shipped text), +0.35% perplexity against +1.87% with one scale per (layer, kv-head)
        # (benchmarks/results/kv_quant_sim_int8_static_gemma3.json); the scales live outside the
        # pages, so the bytes per token do not change.
        KVCacheDtype(
            name="int8_static",
            bits=8,
            scale_kind="static_per_channel",
            description="INT8 with static scales per (layer, kv-head, channel) from a calibration "
            "file",
            v_formats=("int8", "e4m3"),
            context_gather=True,
        ),
        # K per channel over a page of 64 tokens (KIVI's orientation): +1.72% perplexity on
        # SmolLM2 against +6.0% per token (benchmarks/results/kv_quant_sim.json, 64-token pages,
        # no rotation, which measured better than with it). The page's unfinished tokens stay in
        # the model's dtype (the tail) until it fills.
        KVCacheDtype(
            name="int4",
            bits=4,
            scale_kind="per_channel_page",
            group_size=128,
            has_zero_point=True,
            description="4-bit, asymmetric fp16 scale/zero: K per channel of a 64-token page, "
            "V per token and group of 128 channels; each sequence's first page and two newest "
            "in BF16/FP16 (by default)",
            qmax=15.0,
            experimental=True,
            page_tokens=64,
            tail=True,
            context_gather=True,
        ),
    )
}

DTYPE_NAMES: tuple[str, ...] = tuple(CATALOGUE)


def _names(keep: Callable[[KVCacheDtype], bool]) -> tuple[str, ...]:
    return tuple(name for name, entry in CATALOGUE.items() if keep(entry))


# dtypes whose kernels exist in this release (the others are refused at start-up with a message).
KERNEL_DTYPES = _names(lambda d: d.has_kernels)
EXPERIMENTAL_DTYPES = _names(lambda d: d.experimental)
# Page layouts: kernels/page_layout.py's PageLayout (8-bit codes) and Int4PageLayout.
INT8_DTYPES = _names(lambda d: d.bits == 8)
INT4_DTYPES = _names(lambda d: d.bits == 4)
# Dequantized into BF16 for FlashAttention continuations (``context_gather``).
FLASH_CONTEXT_DTYPES = _names(lambda d: d.context_gather)
# Need the vLLM glue's tail pool (``tail``) and a fixed block size (``page_tokens``).
TAIL_DTYPES = _names(lambda d: d.tail)
# The one dtype whose scales come from a calibration file (the unpacking fails unless exactly one).
(STATIC_DTYPE,) = _names(lambda d: d.scale_kind == "static_per_channel")


def dtypes_storing_v_as(v_format: str) -> tuple[str, ...]:
    """The dtypes whose pages can hold V in ``v_format``."""
    return _names(lambda d: v_format in d.v_formats)


def get_dtype(name: str) -> KVCacheDtype:
    """The catalogue entry for ``name``; a clear error for anything else."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ValueError(
            f"unknown int8kv-shim KV-cache dtype {name!r}; known: {', '.join(DTYPE_NAMES)}"
        ) from None

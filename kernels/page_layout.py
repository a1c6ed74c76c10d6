"""Where each byte of a quantized (INT8 / INT4) KV-cache page lives.

The vLLM backend hands the kernels one ``torch.int8`` tensor per layer of shape
``(num_blocks, page_bytes)`` (the block stride may be larger than ``page_bytes`` when vLLM pads
pages). Inside a page the layout is "HND": for each kv-head, the ``block_size`` token rows of that
head are one contiguous chunk, so a kernel tile of one kv-head is a handful of contiguous chunks.

``int8`` (dynamic per-(token, kv-head) fp16 scale), H = num_kv_heads, B = block_size, D = head_size::

    byte 0                                                                      page_bytes
    | K data            | V data            | K scales          | V scales          |
    | int8 [H][B][D]    | int8 [H][D][B]    | fp16 [H][B]       | fp16 [H][B]       |
    ^ k_data = 0        ^ v_data = H*B*D    ^ k_scale = 2*H*B*D ^ v_scale = 2*H*B*D + 2*H*B

    one K data row (token t, head h) = D bytes at k_data + (h*B + t)*D  -> 16-byte aligned
    V is key-major: element d of (token t, head h) at v_data + (h*D + d)*B + t, i.e. for each
    (head, d) the B tokens of the page are one contiguous (16-byte aligned) run
    their scales = fp16 at k_scale + 2*(h*B + t) and v_scale + 2*(h*B + t)

``int8_static`` (per-layer, per-kv-head fp32 scales passed in, nothing per token)::

    | K data int8 [H][B][D] | V data int8 [H][D][B] |      page_bytes = 2*H*B*D

    with ``v_format="e4m3"`` the V bytes are FP8-E4M3FN codes (e4m3.py) instead of int8 integers;
    the layout is the same.

Why this shape:

* one page holds a token's whole state (data and scales), so prefix caching, swapping and
  offloading move it as a unit;
* data rows start at multiples of D (a multiple of 16), never after an inline scale, so every row
  load is a run of 16-byte vector loads (upstream's inline fp32 scale breaks that);
* V is key-major because the attention's PV product reduces over keys: a V tile then reaches shared
  memory with keys contiguous and the matrix-multiply operand is read four keys per 32-bit word.
  Stored D-contiguous like K, the same operand compiled to one byte-wide shared-memory load per
  element (int8 has no transposing ``ldmatrix``), the largest instruction cost of the loop
  (``benchmarks/compile_sm80.py`` checks it stays gone). A token's V is then D single bytes B
  apart, so the write stores a tile of consecutive tokens at a time, token fastest across threads:
  the bytes of consecutive slots share 32-byte sectors (cache_write.py);
* scales sit in their own region after the data, read by the kernels through an fp16 view of the
  same storage (byte offsets / 2), so they cost one small coalesced load per tile.

``int4`` (``Int4PageLayout``: Hadamard-rotated K/V, 4-bit codes, fp16 scale and zero per group of
G elements, NG = D / G groups per (token, head); G = 64 from the catalogue)::

    byte 0                                                                           page_bytes
    | K data            | V data            | K scale/zero          | V scale/zero          |
    | u8 [H][B][D/2]    | u8 [H][D/2][B]    | fp16 [H][B][NG][2]    | fp16 [H][B][NG][2]    |
    ^ k_data = 0        ^ v_data = H*B*D/2  ^ k_sz = H*B*D          ^ v_sz = H*B*D + 4*H*B*NG

    one K data row (token t, head h) = D/2 bytes at k_data + (h*B + t)*D/2 -> 16-byte aligned
    (D >= 32); byte i of the row holds element i in its low nibble and element i + D/2 in its high
    nibble (codes 0..15), so (b & 15) is the tile of dims [0, D/2) and (b >> 4) the tile of
    [D/2, D), no shuffle needed:

        D = 128, G = 64:  low nibbles = group 0,      high nibbles = group 1
        D = 256, G = 64:  low nibbles = groups 0, 1,  high nibbles = groups 2, 3
        D =  64, G = 64:  low and high nibbles together = group 0

    V packs the same byte (elements i and i + D/2 of one token) but is key-major, as int8's V:
    byte i of (token t, head h) at v_data + (h*D/2 + i)*B + t, i.e. for each (head, i) the B
    tokens of the page are one contiguous (16-byte aligned for B >= 16) run.

    scale/zero of group g = fp16 pair at k_sz + 4*((h*B + t)*NG + g) (v_sz for V): (scale, zero),
    the element dequantizes to code * scale + zero (in the rotated basis).

``int4`` V is key-major for the reason int8's is: the PV product's operand then sits in shared
memory with keys contiguous and is read in 32-bit words; stored like K it compiled to byte-wide
shared-memory loads (64 per thread per decode tile, ``benchmarks/compile_sm80.py`` checks they
stay gone). Its bytes keep K's pairing along D, not two keys per byte, so P's columns stay in key
order: a byte of two keys would split every tile's keys into two sets, one per nibble, and P (or
the key order of the scores, masks and scales) would have to be rearranged to match, and a page's
run per (head, element) would be B/2 bytes, 8-byte copies at B = 16.

``page_bytes`` equals ``catalogue.get_dtype(name).page_bytes(B, H, D)`` (checked at construction).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .catalogue import INT4_DTYPES, INT8_DTYPES, get_dtype


@dataclass(frozen=True)
class PageLayout:
    """Byte offsets of the regions of one page (see the module docstring for the diagram)."""

    dtype_name: str
    block_size: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        if self.dtype_name not in INT8_DTYPES:
            hint = " (use Int4PageLayout)" if self.dtype_name in INT4_DTYPES else ""
            raise ValueError(f"no int8 page layout for kv dtype {self.dtype_name!r}{hint}")
        if self.head_size % 16:
            raise ValueError(f"head_size {self.head_size} must be a multiple of 16")
        # Sum of our regions must be exactly what vLLM allocates from the catalogue.
        assert self._end() == get_dtype(self.dtype_name).page_bytes(
            self.block_size, self.num_kv_heads, self.head_size
        )

    @property
    def has_scales(self) -> bool:
        return get_dtype(self.dtype_name).scale_kind == "per_token_head"

    @property
    def data_bytes(self) -> int:
        """Bytes of the K (or V) data region."""
        return self.num_kv_heads * self.block_size * self.head_size

    @property
    def k_data(self) -> int:
        return 0

    @property
    def v_data(self) -> int:
        return self.data_bytes

    @property
    def k_scale(self) -> int:
        """Byte offset of the K scale region (== page end for int8_static, which has none)."""
        return 2 * self.data_bytes

    @property
    def v_scale(self) -> int:
        return self.k_scale + (2 * self.num_kv_heads * self.block_size if self.has_scales else 0)

    def _end(self) -> int:
        return self.v_scale + (2 * self.num_kv_heads * self.block_size if self.has_scales else 0)

    def kernel_constexprs(self) -> dict:
        """The layout's compile-time arguments shared by the int8 write, attention and context
        gather kernels (as ``Int4PageLayout.kernel_constexprs`` for int4). One dict per layout,
        built once: callers unpack it and must not change it."""
        return self._constexprs

    @functools.cached_property
    def _constexprs(self) -> dict:
        return dict(
            HEAD_SIZE=self.head_size,
            BLOCK_SIZE=self.block_size,
            K_DATA=self.k_data,
            V_DATA=self.v_data,
            K_SCALE=self.k_scale,
            V_SCALE=self.v_scale,
            DYNAMIC=self.has_scales,
        )

    @property
    def page_bytes(self) -> int:
        return self._end()


@functools.cache
def cached_page_layout(
    kv_dtype: str, block_size: int, num_kv_heads: int, head_size: int
) -> PageLayout:
    """``PageLayout(...)``, built and checked once per layer shape instead of on every kernel call
    (the launch wrappers run once per layer per step, on the host's critical path)."""
    return PageLayout(kv_dtype, block_size, num_kv_heads, head_size)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1); plain Python, where triton.next_power_of_2 goes
    through Triton's JIT call machinery (microseconds per launch)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Int4PageLayout:
    """Byte offsets of an ``int4`` page's regions (see the module docstring for the diagram)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_name: str = "int4"

    def __post_init__(self) -> None:
        if self.dtype_name not in INT4_DTYPES:
            raise ValueError(f"no int4 page layout for kv dtype {self.dtype_name!r}")
        d, g = self.head_size, self.group_size
        if d < 32 or d & (d - 1):
            raise ValueError(f"int4: head_size {d} must be a power of two >= 32")
        # Groups are whole nibble halves or split them evenly (powers of two: g <= d/2 or g == d).
        if g & (g - 1) or d % g:
            raise ValueError(f"int4: group size {g} must be a power of two dividing head_size {d}")
        assert self._end() == get_dtype(self.dtype_name).page_bytes(
            self.block_size, self.num_kv_heads, self.head_size
        )

    @property
    def group_size(self) -> int:
        g = get_dtype(self.dtype_name).group_size
        return self.head_size if g is None else g

    @property
    def num_groups(self) -> int:
        """(scale, zero) pairs per (token, head), K or V."""
        return self.head_size // self.group_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) vector, two 4-bit codes per byte: a contiguous row for K, one
        byte every ``block_size`` for the key-major V."""
        return self.head_size // 2

    @property
    def data_bytes(self) -> int:
        """Bytes of the K (or V) data region."""
        return self.num_kv_heads * self.block_size * self.row_bytes

    @property
    def piece_bytes(self) -> int:
        """Byte columns the kernels handle as one piece: one group's low (and high) nibbles."""
        return min(self.group_size, self.row_bytes)

    def kernel_constexprs(self) -> dict[str, int]:
        """The layout's compile-time arguments shared by the int4 write and attention kernels."""
        return dict(
            HEAD_SIZE=self.head_size,
            GH=self.piece_bytes,
            NGH=self.row_bytes // self.piece_bytes,
            BLOCK_SIZE=self.block_size,
            K_DATA=self.k_data,
            V_DATA=self.v_data,
            K_SZ=self.k_sz,
            V_SZ=self.v_sz,
        )

    @property
    def sz_bytes(self) -> int:
        """Bytes of the K (or V) scale/zero region: fp16 (scale, zero) per group."""
        return self.num_kv_heads * self.block_size * self.num_groups * 4

    @property
    def k_data(self) -> int:
        return 0

    @property
    def v_data(self) -> int:
        return self.data_bytes

    @property
    def k_sz(self) -> int:
        return 2 * self.data_bytes

    @property
    def v_sz(self) -> int:
        return self.k_sz + self.sz_bytes

    def _end(self) -> int:
        return self.v_sz + self.sz_bytes

    @property
    def page_bytes(self) -> int:
        return self._end()


def get_page_bytes(dtype_name: str, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes of one page of one layer (== catalogue page_bytes)."""
    if dtype_name in INT4_DTYPES:
        return Int4PageLayout(block_size, num_kv_heads, head_size, dtype_name).page_bytes
    return PageLayout(dtype_name, block_size, num_kv_heads, head_size).page_bytes

"""Software FP8-E4M3 (the "FN" variant: no infinities, NaN = 0x7f/0xff) for V pages of ``int8_static``.

Ampere has no FP8 conversion instructions (and Triton's ``tl.float8e4nv`` casts do not lower for
sm80), so the codec is integer/float bit manipulation that compiles anywhere and also runs in the
Triton interpreter the CPU tests use.

E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits. Normal values 2^-6 .. 448 (= 1.75 * 2^8),
subnormals m * 2^-9 for m = 1..7, +-0. The codes 0x7f / 0xff are NaN; we never write them.

Contract (shared by the Triton functions and the torch references below):

* encode(x) = the E4M3FN code nearest to clamp(x, -448, 448), ties to even (the code whose
  mantissa LSB is 0), subnormals exact, -0 kept (0x80). |x| >= 448, +-inf and NaN give +-448
  (0x7e / 0xfe, the sign of x): a NaN code is never produced. For finite x this is bit for bit
  ``clamp(x, -448, 448).to(torch.float8_e4m3fn)``.
* decode(code) = the exact E4M3FN value. The cheap form ``e4m3_decode_f16`` returns value * 2^-8
  as fp16 (exact for every code, subnormals included); callers fold the 2^8 into a scale they
  apply anyway (attention: the static V scale on the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .catalogue import (
    CATALOGUE,
    DEFAULT_V_FORMAT,
    V_FORMAT_CATALOGUE,
    V_FORMATS,
    dtypes_storing_v_as,
)

E4M3_MAX = V_FORMAT_CATALOGUE["e4m3"].qmax
# e4m3_decode_f16 returns value / 256: the fp16 exponent bias (15) is 8 more than E4M3's (7).
E4M3_F16_UNSCALE = 256.0

_MAX = tl.constexpr(E4M3_MAX)
_UNSCALE = tl.constexpr(E4M3_F16_UNSCALE)
_MIN_NORMAL = tl.constexpr(2.0**-6)
# Adding 2^14 to |x| < 2^-6 rounds it to a multiple of 2^-9 (the ulp of 2^14 in fp32, and the
# E4M3 subnormal step) with the FPU's round-to-nearest-even; the low mantissa bits of the sum are
# then the subnormal code m (0..8, and 8 is exactly the code of 2^-6, the smallest normal).
_SUB_MAGIC = tl.constexpr(16384.0)
_SUB_MAGIC_BITS = tl.constexpr(0x46800000)  # fp32 bits of 16384.0
# fp32 bits >> 20 keep sign|exponent|3 mantissa bits; re-biasing the exponent from 127 to 7 is a
# subtraction of (127 - 7) << 3 on that integer.
_REBIAS = tl.constexpr((127 - 7) << 3)
_HALF_MINUS_ONE = tl.constexpr((1 << 19) - 1)  # round-half-even increment below bit 20
# fp16 bit mask after the decode shift: keep the sign (bit 15), drop the duplicated sign at bit 14,
# keep exponent + mantissa (bits 13..7).
_F16_MASK = tl.constexpr(0xBF80)


def check_v_format(kv_dtype: str, v_format: str) -> bool:
    """Validate ``v_format`` for ``kv_dtype``; True when V is stored as E4M3."""
    if v_format not in V_FORMATS:
        raise ValueError(f"v_format must be one of {V_FORMATS}, got {v_format!r}")
    entry = CATALOGUE.get(kv_dtype)
    if v_format != DEFAULT_V_FORMAT and (entry is None or v_format not in entry.v_formats):
        able = " or ".join(map(repr, dtypes_storing_v_as(v_format)))
        raise ValueError(f"v_format {v_format!r} needs kv dtype {able}, not {kv_dtype!r}")
    return v_format == "e4m3"


@triton.jit
def e4m3_encode(x):
    """fp32 (or narrower) -> int8 tensor holding E4M3FN codes (see the module contract)."""
    x = x.to(tl.float32)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80  # arithmetic shift: bit 31 lands on bit 7
    ax = tl.abs(x)
    # where(ax < 448) rather than minimum: NaN fails the comparison and saturates too, so no
    # input can reach the NaN codes (tl.minimum's NaN behaviour differs between GPU and CPU).
    a = tl.where(ax < _MAX, ax, _MAX)
    u = a.to(tl.int32, bitcast=True)
    # Normal range: round the fp32 mantissa to 3 bits, half to even (add 0x7ffff, plus 1 when the
    # kept LSB is odd); a carry out of the mantissa bumps the exponent, which is what we want.
    normal = ((u + (_HALF_MINUS_ONE + ((u >> 20) & 1))) >> 20) - _REBIAS
    sub = (a + _SUB_MAGIC).to(tl.int32, bitcast=True) - _SUB_MAGIC_BITS
    code = tl.where(a < _MIN_NORMAL, sub, normal) | sign
    return code.to(tl.int8)


@triton.jit
def e4m3_decode_f16(b):
    """int8 E4M3FN codes -> fp16 value * 2^-8, exactly (two integer ops and a bitcast).

    Put the code's exponent+mantissa (bits 6..0) under fp16 bits 13..7 and the sign on bit 15:
    an E4M3 exponent field e becomes the fp16 field e (bias 15 instead of 7: a factor 2^-8), and
    the subnormals (e = 0) map onto fp16 subnormals with the same factor. The sign-extended code
    shifted by 7 has the sign on bits 15 and 14; the mask clears bit 14. NaN codes decode as +-480.
    """
    h = (b.to(tl.int32) << 7) & _F16_MASK
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_decode(b):
    """int8 E4M3FN codes -> exact fp32 values (tests; kernels fold the 256 into a scale)."""
    return e4m3_decode_f16(b).to(tl.float32) * _UNSCALE


# ---- plain-torch references (CPU or GPU: torch's float8_e4m3fn conversions) ----------------------


def e4m3_encode_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference encode: int8 tensor of E4M3FN codes of clamp(x, -448, 448) (NaN -> +-448)."""
    xf = x.float()
    sat = torch.where(xf.signbit(), -E4M3_MAX, E4M3_MAX)
    xf = torch.where(xf.abs() < E4M3_MAX, xf, sat)
    return xf.to(torch.float8_e4m3fn).view(torch.int8)


def e4m3_decode_ref(b: torch.Tensor) -> torch.Tensor:
    """Reference decode: fp32 values of int8 E4M3FN codes (NaN codes give NaN)."""
    return b.view(torch.float8_e4m3fn).float()

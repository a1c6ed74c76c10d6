"""Prefill of a prompt's first chunk on its fresh BF16 K/V, with vLLM's FlashAttention-2.

A sequence with no cached context (``num_computed_tokens == 0``) attends only to the tokens it is
bringing in this step, whose K and V the model has just computed in BF16. Reading them back from
the quantized pages would cost a dequantization and give a less exact result; attending over the
fresh tensors is what FlashAttention does for a BF16 cache, at its speed. (TensorRT-LLM does the
same for its quantized caches: context attention on the fresh K/V, the quantized cache for
everything after.) Every other query token -- decodes, chunked-prefill continuations, prefix-cache
hits -- attends over the quantized pages with our kernels. The new tokens' K/V are written into the
cache either way (``do_kv_cache_update`` runs before attention), so later steps read them quantized.

``INT8KV_PREFILL=triton`` turns this off (every token through our kernels, e.g. to measure
accuracy purely through the cache). It is also off where vLLM's FlashAttention-2 cannot run
(no ``vllm.vllm_flash_attn`` build, compute capability < 8.0, head size it lacks).

The split is decided on the host from the batch's CPU metadata (no device sync) in the metadata
builder, never during CUDA-graph capture: a captured graph always runs our kernels for every
sequence, which is correct for any batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from int8kv_shim._logging import get_logger
from int8kv_shim.environment_variables import INT8KV_PREFILL, prefill_mode

logger = get_logger()

# (q, k, v, out, cu_seqlens, max_seqlen, softmax_scale, window, soft_cap) -> None, writing out
FreshAttention = Callable[..., None]


@dataclass
class Subset:
    """Some sequences of a batch, as a compact varlen batch of their own."""

    token_index: torch.Tensor  # int64 [tokens]: rows of query/key/value/output in the full batch
    query_start_loc: torch.Tensor  # int32 [seqs + 1], compacted
    max_query_len: int
    seq_lens: torch.Tensor  # int32 [seqs]: their rows of the batch's seq_lens
    block_table: torch.Tensor  # int32 [seqs, max_blocks]: their rows of the block table


@dataclass
class PrefillSplit:
    """A batch split into fresh prefills (FlashAttention on fresh K/V) and the rest (our kernels)."""

    fresh: Subset
    rest: Subset | None  # None: every sequence is a fresh prefill


def plan_split(
    query_start_loc_cpu: torch.Tensor,
    num_computed_cpu: torch.Tensor,
    num_reqs: int,
    first_seq: int = 0,
) -> tuple[list[int], list[int]] | None:
    """(fresh, rest) sequence indices of a batch, or None when no sequence is a fresh prefill.

    Fresh: no computed tokens and more than one new token (a one-token prompt is left to the decode
    path, so a pure decode batch never splits). Sequences before ``first_seq`` (the decodes the
    impl runs as their own launch) are in neither list.
    """
    qsl = query_start_loc_cpu[: num_reqs + 1].tolist()
    done = num_computed_cpu[:num_reqs].tolist()
    fresh, rest = [], []
    for i in range(first_seq, num_reqs):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue  # padding request: nothing to compute
        (fresh if done[i] == 0 and q_len > 1 else rest).append(i)
    return (fresh, rest) if fresh else None


def make_subset(
    query_start_loc_cpu: torch.Tensor,
    seqs: list[int],
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> Subset:
    """The compact varlen description of ``seqs`` (host work, small copies, two gathers)."""
    device = seq_lens.device
    qsl = query_start_loc_cpu.tolist()
    tokens: list[int] = []
    starts = [0]
    for i in seqs:
        tokens.extend(range(qsl[i], qsl[i + 1]))
        starts.append(len(tokens))
    lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    seq_index = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
    return Subset(
        token_index=torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
        query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
        max_query_len=max(lens),
        seq_lens=seq_lens.index_select(0, seq_index),
        block_table=block_table.index_select(0, seq_index),
    )


def split_batch(
    query_start_loc_cpu: torch.Tensor,
    num_computed_cpu: torch.Tensor | None,
    num_reqs: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    first_seq: int = 0,
) -> PrefillSplit | None:
    """The split of a batch, or None (no fresh prefill, or no CPU copy of the computed counts).

    ``seq_lens`` / ``block_table``: the batch's device tensors (subsets are gathered from them).
    ``first_seq``: as in :func:`plan_split`.
    """
    if num_computed_cpu is None:
        return None
    plan = plan_split(query_start_loc_cpu, num_computed_cpu, num_reqs, first_seq)
    if plan is None:
        return None
    fresh, rest = plan
    return PrefillSplit(
        fresh=make_subset(query_start_loc_cpu, fresh, seq_lens, block_table),
        rest=make_subset(query_start_loc_cpu, rest, seq_lens, block_table) if rest else None,
    )


_failure: str | None = None


def disable(error: BaseException) -> None:
    """Route every later prefill to our kernels after FlashAttention-2 raised (logged once)."""
    global _failure
    if _failure is None:
        _failure = f"{type(error).__name__}: {error}"
        logger.warning(
            "int8kv-shim: FlashAttention-2 failed on a fresh prefill (%s); this process now runs "
            "every prefill on our kernels (set %s=triton to skip the attempt)",
            _failure,
            INT8KV_PREFILL,
        )


def enabled() -> bool:
    """False once :func:`disable` was called in this process."""
    return _failure is None


@functools.cache
def flash_attention(head_size: int) -> FreshAttention | None:
    """vLLM's FlashAttention-2 as a :data:`FreshAttention`, or None where it cannot run here."""
    if prefill_mode() != "flash":
        logger.info("int8kv-shim: %s=triton: prefills run on our kernels", INT8KV_PREFILL)
        return None
    reason = None
    if not torch.cuda.is_available():
        reason = "no GPU"
    elif torch.cuda.get_device_capability() < (8, 0):
        reason = "compute capability < 8.0"
    elif head_size % 8 or head_size > 256:
        reason = f"FlashAttention-2 has no head size {head_size}"
    else:
        try:
            from vllm.v1.attention.backends.fa_utils import is_fa_version_supported
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            if not is_fa_version_supported(2):
                reason = "vLLM's FlashAttention-2 is not supported on this GPU"
        except ImportError as e:  # a vLLM build without vllm_flash_attn
            reason = f"vLLM's FlashAttention is not importable ({e})"
    if reason is not None:
        logger.info("int8kv-shim: fresh prefills run on our kernels: %s", reason)
        return None

    def run(q, k, v, out, cu_seqlens, max_seqlen, softmax_scale, window, soft_cap) -> None:
        flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            out=out,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=softmax_scale,
            causal=True,
            # ours: key j visible from position i when i - j < window; FA: i - j <= window[0]
            window_size=[window - 1, 0] if window else [-1, -1],
            softcap=soft_cap or 0.0,
            fa_version=2,
        )

    logger.info("int8kv-shim: fresh prefills attend over their BF16 K/V with FlashAttention-2")
    return run


def attention_ref(q, k, v, out, cu_seqlens, max_seqlen, softmax_scale, window, soft_cap) -> None:
    """A :data:`FreshAttention` in plain torch (the tests' stand-in for FlashAttention-2)."""
    group = q.shape[1] // k.shape[1]
    starts = cu_seqlens.tolist()
    for a, b in zip(starts, starts[1:], strict=False):
        qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        s = (qs @ ks.transpose(1, 2)) * softmax_scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(b - a)
        visible = pos[:, None] >= pos[None, :]
        if window:
            visible &= (pos[:, None] - pos[None, :]) < window
        s = s.masked_fill(~visible, float("-inf"))
        out[a:b] = (torch.softmax(s, -1) @ vs).transpose(0, 1).to(out.dtype)

"""Prefills on vLLM's FlashAttention-2: over their fresh BF16 K/V, plus their dequantized context.

A sequence that brings more than one new token attends with FlashAttention-2 ("flash" sequences):

* a prompt's **first chunk** (``num_computed_tokens == 0``) attends only to the tokens it brings,
  whose K and V the model has just computed in BF16. Reading them back from the quantized pages
  would cost a dequantization and give a less exact result; attending over the fresh tensors is
  what FlashAttention does for a BF16 cache, at its speed. (TensorRT-LLM does the same for its
  quantized caches.)
* a **chunked-prefill continuation** (``num_computed_tokens > 0``, at least
  ``MIN_CONTINUATION_TOKENS`` new tokens) also needs its context: ``gather_kv_context``
  (``int8kv_kernels``, one Triton launch) dequantizes those tokens from the pages into a temporary
  contiguous BF16/FP16 buffer followed by the new tokens' fresh K/V, and FlashAttention runs varlen
  with ``cu_seqlens_k`` (context + new) apart from ``cu_seqlens_q`` (new). Its causal mask is
  aligned bottom-right when seqlen_k > seqlen_q (flash-attn >= 2.1), i.e. new token i at absolute
  position ctx + i sees keys <= ctx + i, exactly our kernels' rule; the sliding window likewise
  (``window_size=[w - 1, 0]``). vLLM's own TurboQuant backend attends continuations this way. The
  context reads the same quantized values our kernels would; the new tokens are unquantized, as
  for a first chunk. For ``int4`` the gather reads each context key where our int4 attention
  reads it (the sequence's tail slot or sink page, else its int4 page). A continuation whose
  context would push the batch's buffers past ``CONTEXT_BUFFER_BYTES`` stays on our kernels.

Every other query token -- decodes, speculative-decode verifications, short continuations --
attends over the quantized pages with our kernels. The new tokens' K/V are written into the cache
either way before attention (``do_kv_cache_update``; for ``int4`` at the start of the impl's
``forward``), so later steps read them quantized.

``INT8KV_PREFILL=triton`` turns this off (every token through our kernels, e.g. to measure
accuracy purely through the cache). It is also off where vLLM's FlashAttention-2 cannot run
(no ``vllm.vllm_flash_attn`` build, compute capability < 8.0, head size it lacks).

The split is decided on the host from the batch's CPU metadata (no device sync) in the metadata
builder, never during CUDA-graph capture: a captured graph always runs our kernels for every
sequence, which is correct for any batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from int8kv_shim._logging import get_logger
from int8kv_shim.environment_variables import INT8KV_PREFILL, prefill_mode

logger = get_logger()

# (q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window,
#  soft_cap) -> None, writing out; causal with the mask aligned bottom-right (see the docstring)
FlashAttention = Callable[..., None]

# Cap on the temporary K+V context buffers of one layer call: BF16/FP16 copies of every flash
# continuation's context, 2 tensors x 2 bytes per element. They are freed after the layer (the
# caching allocator reuses them), but the peak comes on top of what vLLM planned its KV cache
# around, so it must stay small next to the activations of a large prefill step: 256 MiB is about
# 65K context tokens of an 8-kv-head x 128 model per step, several 8K-prompt continuations.
# A continuation that does not fit stays on our kernels (correct either way, just slower).
CONTEXT_BUFFER_BYTES = 256 << 20

# A continuation with fewer new tokens stays on our kernels. The gather writes the whole context in
# BF16 and FlashAttention reads it again; our kernel reads the int8 pages once and, with few query
# blocks, splits their keys across programs (attention_plan.plan_launch). Over an 8192-token
# sequence on an H100 (benchmarks/results/kernels_continuations.json), 16 to 256 new tokens took
# our kernel 20-62 us against 142 us for the gather + FlashAttention-2 at SmolLM2's 9/3 heads of
# 64, and 31-61 us against 232 us at Gemma 3's 4/1 heads of 256; at 2048 new tokens the gather +
# FlashAttention-2 is the faster (kernels.json: 219 against 441 us at 9/3 heads on an H200). At 512
# new tokens ours is still the faster at 9/3 heads, the gather + FlashAttention-2 at 32/8 heads
# of 128, for int8 and int4 alike (kernels_prefill_int4.json, H100): one threshold for every shape
# and format, continuations of up to 256 new tokens on ours.
MIN_CONTINUATION_TOKENS = 257


def context_bytes_per_token(num_kv_heads: int, head_size: int) -> int:
    """Bytes of the temporary K+V buffers per context token (2 tensors, 2-byte model dtype)."""
    return num_kv_heads * head_size * 2 * 2


@dataclass
class Subset:
    """Some sequences of a batch, as a compact varlen batch of their own."""

    query_start_loc: torch.Tensor  # int32 [seqs + 1], compacted
    max_query_len: int
    seq_lens: torch.Tensor  # int32 [seqs]: their rows of the batch's seq_lens
    block_table: torch.Tensor  # int32 [seqs, max_blocks]: their rows of the block table
    # FlashAttention's key side: context + new tokens per sequence. Without any context (first
    # chunks only) the keys are the new tokens: key_start_loc is query_start_loc, no gather.
    key_start_loc: torch.Tensor | None = None  # int32 [seqs + 1] (cu_seqlens_k)
    max_key_len: int = 0
    num_key_tokens: int = 0
    context_tokens: int = 0  # sum of the contexts: > 0 means gather_kv_context builds the keys
    # (first, end) when the rows are the contiguous run first..end-1 (the usual case: decodes
    # first, then every prefill on FlashAttention): rows are then sliced, not gathered and scattered
    token_range: tuple[int, int] | None = None
    # int32 [seqs]: their rows of the batch's tail slots (dtypes with a tail pool), else None
    slot_of_seq: torch.Tensor | None = None
    # int32 [seqs]: their rows of the batch's sink pages (int4 with sink pages), else None
    sink_of_seq: torch.Tensor | None = None
    # token_index's tensor; for contiguous rows made on first use (from token_range), as slicing
    # needs none
    _token_index: torch.Tensor | None = field(default=None, repr=False)
    # Which rows of the batch's per-sequence tensors are this subset's: first_seq onwards when
    # they are consecutive (_seq_index None), else those of _seq_index (int64, on the device)
    first_seq: int = 0
    _seq_index: torch.Tensor | None = field(default=None, repr=False)

    @property
    def token_index(self) -> torch.Tensor:
        """int64 [tokens]: the rows of query/key/value/output in the full batch."""
        if self._token_index is None:
            assert self.token_range is not None
            self._token_index = torch.arange(*self.token_range, device=self.query_start_loc.device)
        return self._token_index

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This subset's rows of a full-batch tensor: a view when they are contiguous."""
        if self.token_range is not None:
            return x[self.token_range[0] : self.token_range[1]]
        return x.index_select(0, self.token_index)

    def output_rows(self, output: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Where this subset's attention writes: its rows of ``output`` when contiguous (a view),
        else a temporary shaped like its queries ``q``, put back by :meth:`put_rows`."""
        return self.rows(output) if self.token_range is not None else torch.empty_like(q)

    def put_rows(self, output: torch.Tensor, out: torch.Tensor) -> None:
        """Scatter ``out`` (from :meth:`output_rows`) into ``output``; nothing for a view."""
        if self.token_range is None:
            output.index_copy_(0, self.token_index, out)

    def with_block_table(self, block_table: torch.Tensor) -> Subset:
        """The same subset over another block table of the batch (another KV-cache group's
        pages of the same sequences, rows in the same order)."""
        rows = _seq_rows(block_table, self.first_seq, self.seq_lens.shape[0], self._seq_index)
        return dataclasses.replace(self, block_table=rows)


def _seq_rows(
    x: torch.Tensor, first_seq: int, count: int, seq_index: torch.Tensor | None
) -> torch.Tensor:
    """Some sequences' rows of a batch's per-sequence tensor: a view of ``count`` rows from
    ``first_seq`` when they are consecutive (``seq_index`` None), else a gather."""
    if seq_index is None:
        return x[first_seq : first_seq + count]
    return x.index_select(0, seq_index)


@dataclass
class PrefillSplit:
    """A batch split into flash sequences (FlashAttention) and the rest (our kernels)."""

    flash: Subset
    rest: Subset | None  # longer queries left to our kernels; None: there are none
    # Queries of one token left to our kernels (decodes, one-token prompts), launched apart on the
    # decode configuration: vLLM's model runner V2 does not put decodes first in the batch, so
    # they can sit after a prefill, past the impl's leading-decodes launch.
    decodes: Subset | None = None

    def our_kernels(self) -> tuple[Subset, ...]:
        """The subsets our kernels attend, one launch each."""
        return tuple(s for s in (self.decodes, self.rest) if s is not None)

    def with_block_table(self, block_table: torch.Tensor) -> PrefillSplit:
        """The same split over another block table of the batch (:meth:`Subset.with_block_table`)."""
        return PrefillSplit(
            *(s if s is None else s.with_block_table(block_table)
              for s in (self.flash, self.rest, self.decodes))
        )  # fmt: skip


def computed_tokens_cpu(
    query_start_loc_cpu: torch.Tensor,
    num_reqs: int,
    num_computed_cpu: torch.Tensor | None,
    seq_lens_cpu_upper_bound: torch.Tensor | None,
) -> tuple[torch.Tensor | None, bool]:
    """Tokens each request already had in the cache before this step, from the CPU side of vLLM's
    batch metadata (no device sync), and whether the counts are exact.

    vLLM 0.24.0 has two model runners. V1 passes the counts (``_num_computed_tokens_cpu``). V2,
    the default for Llama, Qwen3 and Mistral architectures, passes only
    ``seq_lens_cpu_upper_bound`` = computed + scheduled tokens: exact, except under asynchronous
    speculative decoding, where it assumes every draft token was accepted (so the count can only
    be too high, never too low; the caller must not trust a non-zero one then). Without either,
    (None, False): the step's prefills stay on our kernels.
    """
    if num_computed_cpu is not None:
        return num_computed_cpu[:num_reqs], True
    if seq_lens_cpu_upper_bound is None:
        return None, False
    qsl = query_start_loc_cpu[: num_reqs + 1]
    return seq_lens_cpu_upper_bound[:num_reqs] - (qsl[1:] - qsl[:-1]), False


def plan_split(
    query_start_loc_cpu: torch.Tensor,
    num_computed_cpu: torch.Tensor,
    num_reqs: int,
    max_context_tokens: int = 0,
    min_continuation_tokens: int = MIN_CONTINUATION_TOKENS,
    first_seq: int = 0,
) -> tuple[list[int], list[int]] | None:
    """(flash, rest) sequence indices of a batch, or None when no sequence goes to FlashAttention.

    Flash: more than one new token (a one-token prompt is left to the decode path, so a pure decode
    batch never splits) and either no computed tokens, or at least ``min_continuation_tokens`` new
    ones and a context that still fits in ``max_context_tokens`` together with the contexts of the
    flash continuations before it in the batch (0: continuations stay on our kernels).
    Sequences before ``first_seq`` (the decodes the impl runs as their own launch) are in neither
    list.
    """
    # Array ops, not a loop over requests: every step with prefills passes here (with the loops
    # of split_batch / make_subset, a step of 1024 fresh prompts took 1.7 ms of host time; 0.4 ms
    # with torch ops). NumPy, on views of the CPU tensors: a torch op on a tensor this small
    # costs a few us of dispatch, NumPy's a fraction of that (benchmarks/host_overhead.py).
    qsl = query_start_loc_cpu[first_seq : num_reqs + 1].numpy().astype(np.int64)
    q_len = qsl[1:] - qsl[:-1]
    ctx = num_computed_cpu[first_seq:num_reqs].numpy().astype(np.int64)
    flash = (q_len > 1) & (ctx == 0)
    # Continuations take the context budget in batch order (few per step: a loop over them only).
    fits = (
        (q_len > 1) & (q_len >= min_continuation_tokens) & (ctx > 0) & (ctx <= max_context_tokens)
    )
    candidates = np.flatnonzero(fits).tolist()
    budget = max_context_tokens
    for i, c in zip(candidates, ctx[candidates].tolist(), strict=True):
        if c <= budget:
            flash[i] = True
            budget -= c
    if not flash.any():
        return None
    seqs = np.arange(first_seq, num_reqs)
    # padding requests (no tokens) are in neither list: nothing to compute
    return seqs[flash].tolist(), seqs[~flash & (q_len > 0)].tolist()


def make_subset(
    query_start_loc_cpu: torch.Tensor,
    seqs: list[int],
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_computed_cpu: torch.Tensor | None = None,
    slot_of_seq: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> Subset:
    """The compact varlen description of ``seqs`` (host work, one small copy to the device).

    Consecutive sequences (the usual case) take views of the batch's device tensors; others are
    gathered with an index copied to the device. The copies come from pageable memory: CUDA stages
    a small one and returns without waiting for the queued kernels
    (benchmarks/results/launch_overhead.json, ``h2d_pageable_wait_ms``: 0.03 ms with a 0.2 s
    kernel queued), so they do not stall vLLM's asynchronous scheduling; each still costs host
    time, so query_start_loc and key_start_loc travel as one copy.

    With ``num_computed_cpu``, also FlashAttention's key side (context + new tokens).
    """
    device = seq_lens.device
    index = np.asarray(seqs, dtype=np.int64)
    qsl = query_start_loc_cpu.numpy()
    first = qsl[index].astype(np.int64)  # each sequence's first row in the batch
    lens = qsl[index + 1] - first
    ends = np.cumsum(lens)
    num_tokens = int(ends[-1])
    # row of a sequence's token j = its offset + subset row
    offsets = first - (ends - lens)
    run = None
    if (offsets == offsets[0]).all():
        run = (int(offsets[0]), int(offsets[0]) + num_tokens)
    starts = np.zeros(len(seqs) + 1, dtype=np.int64)
    starts[1:] = ends
    key_starts = None
    context_tokens = max_key_len = num_key_tokens = 0
    if num_computed_cpu is not None:
        key_lens = num_computed_cpu.numpy()[index].astype(np.int64) + lens
        context_tokens = int(key_lens.sum()) - num_tokens
        max_key_len = int(key_lens.max())
        num_key_tokens = int(key_lens.sum())
        if context_tokens:
            key_starts = np.zeros_like(starts)
            key_starts[1:] = np.cumsum(key_lens)
    host = starts if key_starts is None else np.concatenate([starts, key_starts])
    # one copy: query_start_loc, then key_start_loc when there is a context
    starts_dev = torch.from_numpy(host.astype(np.int32)).to(device, non_blocking=True)
    query_start_loc = starts_dev[: len(seqs) + 1]
    key_start_loc = query_start_loc if key_starts is None else starts_dev[len(seqs) + 1 :]
    token_index = None
    if run is None:
        # rows of the subset's tokens, sequence after sequence (array ops: a 16K-token prefill
        # step made a Python list of 16K ints here, ~1 ms of host time per step)
        tokens = np.arange(num_tokens) + np.repeat(offsets, lens)
        token_index = torch.from_numpy(tokens).to(device, non_blocking=True)
    seq_index = None
    if not (index[1:] - index[:-1] == 1).all():  # consecutive sequences take views
        seq_index = torch.from_numpy(index).to(device, non_blocking=True)

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _seq_rows(x, seqs[0], len(seqs), seq_index)

    return Subset(
        query_start_loc=query_start_loc,
        max_query_len=int(lens.max()),
        seq_lens=rows(seq_lens),
        block_table=rows(block_table),
        key_start_loc=None if num_computed_cpu is None else key_start_loc,
        max_key_len=max_key_len,
        num_key_tokens=num_key_tokens,
        context_tokens=context_tokens,
        token_range=run,
        slot_of_seq=rows(slot_of_seq),
        sink_of_seq=rows(sink_of_seq),
        _token_index=token_index,
        first_seq=seqs[0],
        _seq_index=seq_index,
    )


def split_batch(
    query_start_loc_cpu: torch.Tensor,
    num_computed_cpu: torch.Tensor | None,
    num_reqs: int,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_tokens: int = 0,
    min_continuation_tokens: int = MIN_CONTINUATION_TOKENS,
    first_seq: int = 0,
    slot_of_seq: torch.Tensor | None = None,
    sink_of_seq: torch.Tensor | None = None,
) -> PrefillSplit | None:
    """The split of a batch, or None (nothing for FlashAttention, or no CPU computed counts).

    ``seq_lens`` / ``block_table`` / ``slot_of_seq`` (tail slots, or None) / ``sink_of_seq``
    (sink pages, or None): the batch's device tensors (subsets are gathered from them).
    ``max_context_tokens`` / ``min_continuation_tokens`` / ``first_seq``: as in :func:`plan_split`.
    """
    if num_computed_cpu is None:
        return None
    plan = plan_split(
        query_start_loc_cpu, num_computed_cpu, num_reqs, max_context_tokens,
        min_continuation_tokens, first_seq,
    )  # fmt: skip
    if plan is None:
        return None
    flash, rest = plan
    one: list[int] = []
    longer: list[int] = []
    if rest:
        rest_np = np.asarray(rest, dtype=np.int64)
        qsl = query_start_loc_cpu.numpy()
        single = (qsl[rest_np + 1] - qsl[rest_np]) == 1
        one, longer = rest_np[single].tolist(), rest_np[~single].tolist()

    def subset(seqs: list[int]) -> Subset | None:
        if not seqs:
            return None
        return make_subset(query_start_loc_cpu, seqs, seq_lens, block_table, None, slot_of_seq,
                           sink_of_seq)  # fmt: skip

    return PrefillSplit(
        flash=make_subset(
            query_start_loc_cpu,
            flash,
            seq_lens,
            block_table,
            num_computed_cpu,
            slot_of_seq,
            sink_of_seq,
        ),
        rest=subset(longer),
        decodes=subset(one),
    )


def forward_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    split: PrefillSplit,
    *,
    flash_attention: FlashAttention,
    gather_context: Callable[[torch.Tensor, torch.Tensor, Subset], tuple[torch.Tensor, ...]],
    paged: Callable[[torch.Tensor, torch.Tensor, Subset], None],
    softmax_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Attention of a split batch into ``output``: flash sequences on ``flash_attention``, the rest
    on ``paged`` (our kernels: ``paged(q, out, subset)``).

    ``gather_context(new_k, new_v, flash_subset) -> (k, v)`` builds the keys of flash sequences
    with context (``gather_kv_context`` bound to the layer's cache). Raises
    :class:`FlashAttentionFailed` when FlashAttention refuses the call, before ``output`` was
    written, so the caller can redo every row on our kernels; errors of our kernels propagate as
    they are.
    """
    # Contiguous rows are views (FlashAttention and our kernels take row strides), so the usual
    # batch costs no gather of q/k/v and no scatter of the output.
    flash = split.flash
    q, k, v = (flash.rows(x) for x in (query, key, value))
    if flash.context_tokens:
        k, v = gather_context(k, v, flash)
    out = flash.output_rows(output, q)
    try:
        flash_attention(q, k, v, out, flash.query_start_loc, flash.key_start_loc,
                        flash.max_query_len, flash.max_key_len, softmax_scale, sliding_window,
                        soft_cap)  # fmt: skip
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        # Only FlashAttention's own refusals: an error of our kernels (the gather above, the
        # launches below) is theirs to report, not a reason to route prefills elsewhere.
        raise FlashAttentionFailed(e) from e
    flash.put_rows(output, out)
    for rest in split.our_kernels():
        q = rest.rows(query)
        out = rest.output_rows(output, q)
        paged(q, out, rest)
        rest.put_rows(output, out)
    return output


class FlashAttentionFailed(RuntimeError):
    """FlashAttention-2 raised on a split batch (its ``__cause__``), before writing ``output``."""


_failure: str | None = None


def disable(error: BaseException) -> None:
    """Route every later prefill to our kernels after FlashAttention-2 raised (logged once)."""
    global _failure
    if _failure is None:
        _failure = f"{type(error).__name__}: {error}"
        logger.warning(
            "int8kv-shim: FlashAttention-2 failed on a prefill (%s); this process now runs "
            "every prefill on our kernels (set %s=triton to skip the attempt)",
            _failure,
            INT8KV_PREFILL,
        )


def enabled() -> bool:
    """False once :func:`disable` was called in this process."""
    return _failure is None


@functools.cache
def flash_attention(head_size: int) -> FlashAttention | None:
    """vLLM's FlashAttention-2 as a :data:`FlashAttention`, or None where it cannot run here."""
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
        logger.info("int8kv-shim: prefills run on our kernels: %s", reason)
        return None

    def run(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            window, soft_cap) -> None:  # fmt: skip
        flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            # keys = context + new tokens; with seqlen_k > seqlen_q FA2's causal mask is aligned
            # bottom-right (query i at position seqlen_k - seqlen_q + i), as our kernels' is
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=True,
            # ours: key j visible from position i when i - j < window; FA: i - j <= window[0]
            window_size=[window - 1, 0] if window else [-1, -1],
            softcap=soft_cap or 0.0,
            fa_version=2,
        )

    logger.info(
        "int8kv-shim: prefills attend over their BF16 K/V (and dequantized context) with "
        "FlashAttention-2"
    )
    return run


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window: int | None,
    soft_cap: float | None,
) -> None:
    """A :data:`FlashAttention` in plain torch (the tests' stand-in for FlashAttention-2): causal
    with the mask aligned bottom-right, query i of a sequence at position seqlen_k - seqlen_q + i."""
    group = q.shape[1] // k.shape[1]
    qs_, ks_ = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(qs_) - 1):
        (a, b), (c, e) = (qs_[s], qs_[s + 1]), (ks_[s], ks_[s + 1])
        qs = q[a:b].float().transpose(0, 1)
        ks, vs = (x[c:e].float().transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        sc = (qs @ ks.transpose(1, 2)) * softmax_scale
        if soft_cap:
            sc = soft_cap * torch.tanh(sc / soft_cap)
        pos = torch.arange(b - a)[:, None] + (e - c) - (b - a)
        j = torch.arange(e - c)[None, :]
        visible = j <= pos
        if window:
            visible &= (pos - j) < window
        sc = sc.masked_fill(~visible, float("-inf"))
        out[a:b] = (torch.softmax(sc, -1) @ vs).transpose(0, 1).to(out.dtype)

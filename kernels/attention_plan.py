"""What the attention formats share: launch planning (configs, KV splits, the split-KV workspace),
the split merge kernel, a program's query block, rows and keys, and the online-softmax step.

``attention.py`` (int8 pages) and ``attention_int4.py`` (int4 pages + tail) each choose their own
tile config (``LaunchConfig``) and kernel; everything that decides how a batch is cut into
programs, how long contexts are split (flash-decoding) and how the partials merge is here, once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import DirectLauncher, Replay
from .page_layout import next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)
# Running max starts finite so a row that has seen only masked keys gives exp2(-inf - m) = 0 and
# alpha = exp2(0) = 1 instead of NaN from (-inf) - (-inf).
M_INIT = tl.constexpr(-1.0e30)

# Upper bound on KV splits of one (sequence, kv-head); workspaces are sized with it.
MAX_SPLITS = 32
# A split shorter than this costs more in partial-result traffic and merge than it saves.
MIN_TOKENS_PER_SPLIT = 128
# Past one program per SM, split further only while splits keep this many keys: on an H200
# (benchmarks/results/tune_decode.json) batch 8 x 8K ran 57 us at 4 splits of 2K against 64 us
# at 8 of 1K, and batch 32 x 8K 177 us at 2 splits of 4K against 213 us unsplit.
MIN_TOKENS_PER_EXTRA_SPLIT = 2048


@triton.jit
def find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr, PER_SEQ: tl.constexpr = 1):
    """The sequence owning program ``pid`` when the programs of sequence s are numbered from
    qsl[s] // BLOCK_Q + PER_SEQ * s (an upper bound on the blocks of earlier sequences that needs
    no prefix sum of per-sequence block counts): a binary search over query_start_loc."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid * PER_SEQ <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def query_block(qsl_ptr, pid_q, num_seqs, BLOCK_Q: tl.constexpr):
    """Program ``pid_q``'s query block: (seq, q_start, q_len, qb), its sequence, the sequence's
    first query token and query count, and the block's index in it. The grid has a block for
    every sequence's worst case: one with qb * BLOCK_Q >= q_len has no queries (its program
    returns)."""
    seq = find_seq(qsl_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    qb = pid_q - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_len, qb


@triton.jit
def block_rows(q_start, q_len, qb, kvh, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
               GROUP: tl.constexpr):  # fmt: skip
    """The block's BLOCK_M rows, BLOCK_Q query tokens x the GROUP query heads of kv-head kvh:
    (q_idx, head, row_ok, token), each row's query index in the sequence, query head, whether
    it is a real row (not padding, not past the sequence's queries) and token index (int64)."""
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = qb * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    return q_idx, head, row_ok, token


@triton.jit
def visible_keys(ctx, seq_len, qb, window, split, num_splits, BLOCK_Q: tl.constexpr,
                 WINDOW_ALIGN: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                 SPLIT: tl.constexpr):  # fmt: skip
    """The keys [key_lo, key_hi) this program reads: those the block's queries can see (from
    the window's first, rounded down to WINDOW_ALIGN, the loop's alignment), cut into
    ``num_splits`` runs of whole TILE_N tiles, run ``split`` of them when SPLIT."""
    key_hi = tl.minimum(ctx + (qb + 1) * BLOCK_Q, seq_len)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0)
        key_lo = (key_lo // WINDOW_ALIGN) * WINDOW_ALIGN
    if SPLIT:
        n_tiles = tl.cdiv(key_hi - key_lo, TILE_N)
        per_split = tl.cdiv(n_tiles, num_splits) * TILE_N
        key_lo = key_lo + split * per_split
        key_hi = tl.minimum(key_lo + per_split, key_hi)
    return key_lo, key_hi


@triton.jit
def score_scale_of(softmax_scale, USE_SOFTCAP: tl.constexpr):
    """The factor of q . k in softmax_step's units: log2 (exp2 is the fast one) unless a soft cap
    comes first (its tanh takes natural units; softmax_step converts after it)."""
    score_scale = softmax_scale
    if not USE_SOFTCAP:
        score_scale = score_scale * LOG2E
    return score_scale


@triton.jit
def store_split_stats(ws_m_ptr, ws_l_ptr, token, head, split, num_splits, m_i, l_i, row_ok,
                      NUM_Q_HEADS: tl.constexpr):  # fmt: skip
    """A split program's running max and sum into the workspace (merge_splits reads them);
    returns the rows' workspace index, where its partial output goes too."""
    ws = (token * NUM_Q_HEADS + head) * num_splits + split
    tl.store(ws_m_ptr + ws, m_i, mask=row_ok)
    tl.store(ws_l_ptr + ws, l_i, mask=row_ok)
    return ws


@triton.jit
def soft_capped(s, soft_cap):
    """soft_cap * tanh(s / soft_cap) of natural-unit scores, in log2 units (softmax_step's),
    with tanh(x) = 2 sigmoid(2x) - 1."""
    return soft_cap * (2.0 * tl.sigmoid(s * (2.0 / soft_cap)) - 1.0) * LOG2E


@triton.jit
def softmax_step(
    s, key, key_ok, pos, window, soft_cap, m_i, l_i, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Soft-cap, causal (and window) mask and one online-softmax step on a [BLOCK_M, TILE_N] tile
    of scaled scores (log2 units unless soft-capped): (p, alpha, new running max, new sum)."""
    if USE_SOFTCAP:
        s = soft_capped(s, soft_cap)
    visible = key_ok[None, :] & (key[None, :] <= pos[:, None])
    if USE_WINDOW:
        visible = visible & (pos[:, None] - key[None, :] < window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


# The batch metadata a mixed batch slices after its decodes (the rest start at any row): the
# attention and int4 write kernels do not specialize on these pointers' 16-byte alignment.
SLICED_METADATA_PTRS = ["block_table_ptr", "qsl_ptr", "seq_lens_ptr"]


@triton.jit(  # as _attn_fwd
    do_not_specialize=["num_seqs", "num_splits"], do_not_specialize_on_alignment=["qsl_ptr"]
)
def merge_splits(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    qsl_ptr,
    num_seqs,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    S_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_seqs):  # padding token beyond the batch: nothing was computed
        return
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    s_ok = offs_s < num_splits
    ws = (t * NUM_Q_HEADS + h) * num_splits + offs_s
    m = tl.load(ws_m_ptr + ws, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ws_l_ptr + ws, mask=s_ok, other=0.0)
    acc = tl.load(
        ws_acc_ptr + ws[:, None] * HEAD_SIZE + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    w = tl.exp2(m - tl.max(m, axis=0))  # splits that saw no key hold m = -1e30: weight 0
    total = tl.sum(l_s * w, axis=0)
    # no key at all (int4: a slot-less sequence's tail page is not read): 0, not 0/0
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


launch_merge = DirectLauncher(merge_splits)


@dataclass(frozen=True)
class AttentionWorkspace:
    """Scratch for split-KV partial results; allocate once (``make_workspace``) for CUDA graphs."""

    acc: torch.Tensor  # fp32, flat: [tokens][q_heads][splits][head_size]
    m: torch.Tensor  # fp32, flat: [tokens][q_heads][splits] running max (log2 units)
    l: torch.Tensor  # noqa: E741  fp32, same shape: softmax denominator

    def max_splits_for(self, num_tokens: int, num_q_heads: int, head_size: int) -> int:
        """Largest power-of-two split count (<= MAX_SPLITS) whose partials fit."""
        rows = num_tokens * num_q_heads
        fit = min(self.m.numel() // rows, self.acc.numel() // (rows * head_size), MAX_SPLITS)
        return 1 << (fit.bit_length() - 1) if fit >= 1 else 1


def make_workspace(
    max_num_tokens: int,
    num_q_heads: int,
    head_size: int,
    max_splits: int = MAX_SPLITS,
    device: torch.device | str | None = None,
) -> AttentionWorkspace:
    """Split-KV scratch for up to ``max_num_tokens`` decode tokens with up to ``max_splits`` splits:
    max_num_tokens * num_q_heads * max_splits * (head_size + 2) * 4 bytes.

    Pass the same one to every ``paged_attention`` call (layers run one after another). A call whose
    partials would not fit uses fewer splits: never an allocation, never a wrong result.
    """
    n = max_num_tokens * num_q_heads * max_splits
    return AttentionWorkspace(
        acc=torch.empty(n * head_size, dtype=torch.float32, device=device),
        m=torch.empty(n, dtype=torch.float32, device=device),
        l=torch.empty(n, dtype=torch.float32, device=device),
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so the CPU tests exercise splitting
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    split: bool
    chunks: int = 1  # > 1: split-K inside the program (attention.py's chunked decode loop)


# Shared memory one program may use on sm86 (A10, A40, A6000, RTX 3090), the smallest of the
# targets (sm80: 163 KiB, sm90: 227 KiB). A program above it does not launch there ("out of
# resources"); benchmarks/compile_sm80.py checks every default specialisation against it.
MAX_SHARED_BYTES = 99 * 1024


@functools.cache
def _cc_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def device_cc_major(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter
    return _cc_major(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    sm_count: int,
    max_splits: int = MAX_SPLITS,
    sliding_window: int | None = None,
) -> int:
    """Power-of-two KV splits per (sequence or query block, kv-head) program.

    Splits until there is a program per SM; then on towards two per SM only while every split
    keeps MIN_TOKENS_PER_EXTRA_SPLIT keys, since a short split's fixed cost (Q load, pipeline
    fill, partials, merge) outweighs the extra parallelism. Never a split shorter than
    MIN_TOKENS_PER_SPLIT. A sliding-window layer reads at most its window's keys however long the
    sequence, so its splits are sized for the window. Only performance depends on it: any value
    gives the same result.
    """
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window)
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits * 2 <= max_splits and max_seq_len >= 2 * splits * MIN_TOKENS_PER_SPLIT:
        filled = programs * splits >= sm_count
        if filled and (
            programs * splits >= 2 * sm_count
            or max_seq_len < 2 * splits * MIN_TOKENS_PER_EXTRA_SPLIT
        ):
            break
        splits *= 2
    return splits


def check_shapes(
    query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, num_kv_heads: int
) -> None:
    num_q_heads, head_size = query.shape[1], query.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if head_size & (head_size - 1):
        raise ValueError(f"head_size {head_size} must be a power of two")
    if query.stride(2) != 1 or output.stride(2) != 1:
        raise ValueError("query/output must be contiguous along head_size")
    if kv_cache.dtype != torch.int8 or kv_cache.stride(1) != 1 or kv_cache.stride(0) % 2:
        raise ValueError("kv_cache must be int8 [num_blocks, page_bytes] with an even block stride")


@dataclass(frozen=True)
class LaunchPlan:
    cfg: LaunchConfig
    block_q: int  # query tokens per program
    num_q_blocks: int  # grid dim 0
    splits: int  # grid dim 2; > 1: partials go to ``workspace`` and need a merge
    workspace: AttentionWorkspace | None


def plan_launch(
    query: torch.Tensor,
    cfg: LaunchConfig,
    num_seqs: int,
    group: int,
    max_seq_len: int,
    num_kv_heads: int,
    workspace: AttentionWorkspace | None,
    num_splits: int | None,
    sliding_window: int | None = None,
) -> LaunchPlan:
    """Launch shape of an attention kernel with config ``cfg`` (chosen by the format's module)
    from Python ints only: query blocks, KV splits, and the workspace the splits use.

    Both configurations split long contexts while the grid would leave SMs idle. A decode program
    is one (sequence, kv-head). A prefill program is one (query block, kv-head), and a few new
    tokens over a long context make very few of them: the last 31 tokens of an 8K prompt chunked
    beside 31 decodes are one query block, so one program per kv-head would walk all 8K keys.
    """
    num_tokens, num_q_heads, head_size = query.shape
    block_q = cfg.block_m // group
    max_splits = MAX_SPLITS
    if workspace is not None:
        max_splits = workspace.max_splits_for(num_tokens, num_q_heads, head_size)
    if num_splits is not None:
        splits = min(num_splits, max_splits)
    else:
        # the query blocks of a prefill batch: at least one per sequence, and no fewer than its
        # tokens fill (the grid's num_tokens // block_q + num_seqs is an upper bound)
        blocks = num_seqs if cfg.split else max(num_seqs, -(-num_tokens // block_q))
        sms = device_sms(query.device)
        splits = choose_num_splits(
            blocks, num_kv_heads, max_seq_len, sms, max_splits, sliding_window
        )
    if splits > 1 and workspace is None:
        workspace = make_workspace(num_tokens, num_q_heads, head_size, splits, query.device)
    return LaunchPlan(cfg, block_q, num_tokens // block_q + num_seqs, splits, workspace)


def launch_split_merge(
    output: torch.Tensor,
    workspace: AttentionWorkspace,
    query_start_loc: torch.Tensor,
    num_seqs: int,
    splits: int,
    launcher: DirectLauncher | None = None,
) -> Replay | None:
    """Merge the split-KV partials in ``workspace`` into ``output`` [tokens, q_heads, head_size];
    returns the launch's Replay (swapping ``output`` and ``query_start_loc``: ``out_ptr``,
    ``qsl_ptr``) where it went direct. ``launcher``: the
    merge's launcher as the caller's module holds it (tests swap it there), ``launch_merge``
    by default."""
    num_tokens, num_q_heads, head_size = output.shape
    return (launcher or launch_merge).record(
        [("out_ptr",), ("qsl_ptr",)],
        (num_tokens, num_q_heads),
        output,
        workspace.acc,
        workspace.m,
        workspace.l,
        query_start_loc,
        num_seqs,
        splits,
        output.stride(0),
        output.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_SIZE=head_size,
        S_PAD=next_power_of_2(splits),
        num_warps=4,
    )

"""The keys under which paged_attention, write_kv_cache and gather_kv_context, and int4's
paged_attention_int4, write_kv_cache_int4 and write_sink_int4, replay a launch (kernels/launch.py,
ReplayCache) must tell apart every call that would launch differently.

A replay reuses everything of the recorded launch but the calling layer's own tensors (query,
output, cache, new K/V, static scales, the gather's output buffers), whose dtype, device and
alignment it checks itself. So any other argument, and the shapes and strides of the swapped
tensors, must change the key; the swapped tensors' storage alone must not. The calls here stop at
the key (a stub cache answers "replayed"), so they need no GPU and launch nothing.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import int8kv_kernels.attention as attention
import int8kv_kernels.attention_int4 as attention_int4
import int8kv_kernels.attention_plan as attention_plan
import int8kv_kernels.cache_write as cache_write
import int8kv_kernels.cache_write_int4 as cache_write_int4
import int8kv_kernels.context_gather as context_gather
from int8kv_kernels import get_page_bytes, make_workspace

NQ, NKV, D, BS = 8, 2, 64, 16


def _int32(*shape: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """An int32 tensor at the start of an int64 buffer, so that _as_int64 can give one with the same
    address, shape and strides which only the dtype tells apart."""
    buffer = torch.zeros(64, dtype=torch.int64)
    t = buffer.view(torch.int32)[: torch.Size(shape).numel()].view(shape)
    if fill is not None:
        t.copy_(fill)
    t.buffer = buffer
    return t


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    out = t.buffer[: t.numel()].view(t.shape)
    assert out.data_ptr() == t.data_ptr() and out.stride() == t.stride()
    return out


class _KeyRecorder:
    def __init__(self):
        self.keys = []

    def run(self, key, **tensors):
        self.keys.append(key)
        return True  # "replayed": the wrapper returns before any check or launch


def _attention_args():
    pages = get_page_bytes("int8", BS, NKV, D)
    q = torch.randn(4, NQ, D, dtype=torch.bfloat16)
    return dict(
        query=q, kv_cache=torch.zeros(8, pages, dtype=torch.int8), output=torch.empty_like(q),
        kv_dtype="int8", block_size=BS, num_kv_heads=NKV,
        query_start_loc=_int32(5, fill=torch.arange(5)), seq_lens=_int32(4, fill=torch.tensor(20)),
        block_table=_int32(4, 2, fill=torch.arange(8).view(4, 2)), max_query_len=1,
        max_seq_len=20, softmax_scale=0.125, sliding_window=None, soft_cap=None, k_scale=None,
        v_scale=None, workspace=None, num_splits=None, v_format="int8", tail=None, slot_of_seq=None,
        tail_page=None, sink=None, sink_of_seq=None,
    )  # fmt: skip


def _any_attention_changes(a):
    """Calls that must get another key than ``a``, for the parameters both attention wrappers
    (paged_attention, paged_attention_int4) take."""
    q, out, cache = a["query"], a["output"], a["kv_cache"]
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.int8)
    return {
        "query": [q[:3], torch.randn(4, 2 * NQ, D, dtype=q.dtype)[:, ::2]],
        "output": [torch.empty(4, 2 * NQ, D, dtype=out.dtype)[:, ::2], out[:3]],
        "kv_cache": [wide[:, : cache.shape[1]]],
        "query_start_loc": [a["query_start_loc"][:4], _as_int64(a["query_start_loc"])],
        "seq_lens": [a["seq_lens"][:3], _as_int64(a["seq_lens"])],
        "block_table": [torch.zeros(4, 3, dtype=torch.int32)[:, :2], _as_int64(a["block_table"])],
        "max_query_len": [2], "max_seq_len": [4096], "softmax_scale": [0.1],
        "sliding_window": [8], "soft_cap": [30.0],
        "workspace": [make_workspace(4, NQ, D, device="cpu")], "num_splits": [2],
    }  # fmt: skip


def _attention_changes(a):
    """Per parameter of paged_attention, calls that must get another key than ``a``."""
    return _any_attention_changes(a) | {
        "kv_dtype": ["int8_static"], "block_size": [32], "num_kv_heads": [4],
        "k_scale": [torch.ones(NKV, D)], "v_scale": [torch.ones(NKV, D)], "v_format": ["e4m3"],
        # int4's (ignored by int8 pages, but part of the call)
        "tail": [torch.zeros(1, 2, NKV, 64, D, dtype=torch.bfloat16)],
        "slot_of_seq": [_int32(4)], "tail_page": [_int32(1)],
        "sink": [torch.zeros(1, 2, NKV, 64, D, dtype=torch.bfloat16)], "sink_of_seq": [_int32(4)],
    }  # fmt: skip


def _write_args():
    pages = get_page_bytes("int8", BS, NKV, D)
    k = torch.randn(4, NKV, D, dtype=torch.bfloat16)
    return dict(
        key=k, value=torch.randn_like(k), kv_cache=torch.zeros(8, pages, dtype=torch.int8),
        slot_mapping=_int32(4, fill=torch.arange(4)), kv_dtype="int8", block_size=BS, k_scale=None,
        v_scale=None, v_format="int8", **dict.fromkeys(INT4_WRITE_ARGS),
    )  # fmt: skip


# write_kv_cache's int4 keywords: ignored by int8 pages, but part of the call
INT4_WRITE_ARGS = ("tail", "tail_page", "query_start_loc", "seq_lens", "block_table", "slot_of_seq",
                   "slot_is_new", "num_seqs", "max_query_len")  # fmt: skip


def _write_changes(a):
    k, cache = a["key"], a["kv_cache"]
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.int8)
    strided = torch.randn(4, 2 * NKV, D, dtype=k.dtype)[:, ::2]
    return {
        "key": [k[:3], strided], "value": [a["value"][:3], strided], "kv_cache": [wide[:, :-16]],
        "slot_mapping": [a["slot_mapping"][:3], _as_int64(a["slot_mapping"])],
        "kv_dtype": ["int8_static"], "block_size": [32], "k_scale": [torch.ones(NKV, D)],
        "v_scale": [torch.ones(NKV, D)], "v_format": ["e4m3"],
        **{name: [1] for name in INT4_WRITE_ARGS},
    }  # fmt: skip


def _gather_batch(kv_dtype: str, block_size: int) -> dict:
    """Both gathers' arguments but each format's own: two sequences' new K/V over a cache."""
    pages = get_page_bytes(kv_dtype, block_size, NKV, D)
    k = torch.randn(4, NKV, D, dtype=torch.bfloat16)
    return dict(
        kv_cache=torch.zeros(8, pages, dtype=torch.int8), new_key=k, new_value=torch.randn_like(k),
        kv_dtype=kv_dtype, block_size=block_size,
        block_table=_int32(2, 2, fill=torch.arange(4).view(2, 2)),
        cu_seqlens_q=_int32(3, fill=torch.tensor([0, 2, 4])),
        cu_seqlens_k=_int32(3, fill=torch.tensor([0, 10, 20])), max_seqlen_k=10, num_k_tokens=20,
    )  # fmt: skip


def _gather_args():
    return dict(
        **_gather_batch("int8", BS), k_scale=None, v_scale=None, v_format="int8",
        **dict.fromkeys(INT4_GATHER_ARGS),
    )  # fmt: skip


# gather_kv_context's int4 keywords: ignored by int8 pages, but part of the call
INT4_GATHER_ARGS = ("tail", "tail_page", "slot_of_seq", "sink", "sink_of_seq")


def _gather_changes(a):
    k, cache = a["new_key"], a["kv_cache"]
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.int8)
    strided = torch.randn(4, 2 * NKV, D, dtype=k.dtype)[:, ::2]
    return {
        "kv_cache": [wide[:, : cache.shape[1]]], "new_key": [k[:3], strided],
        "new_value": [a["new_value"][:3], strided], "kv_dtype": ["int8_static"],
        "block_size": [32],
        "block_table": [torch.zeros(2, 3, dtype=torch.int32)[:, :2], _as_int64(a["block_table"])],
        "cu_seqlens_q": [a["cu_seqlens_q"][:2], _as_int64(a["cu_seqlens_q"])],
        "cu_seqlens_k": [a["cu_seqlens_k"][:2], _as_int64(a["cu_seqlens_k"])],
        "max_seqlen_k": [11], "num_k_tokens": [21], "k_scale": [torch.ones(NKV, D)],
        "v_scale": [torch.ones(NKV, D)], "v_format": ["e4m3"],
        **{name: [1] for name in INT4_GATHER_ARGS},
    }  # fmt: skip


CASES = {
    "paged_attention": (attention, attention.paged_attention, _attention_args, _attention_changes,
                        ("query", "output", "kv_cache", "k_scale", "v_scale", "query_start_loc",
                         "seq_lens", "block_table")),
    "write_kv_cache": (cache_write, cache_write.write_kv_cache, _write_args, _write_changes,
                       ("key", "value", "kv_cache", "k_scale", "v_scale", "slot_mapping")),
    "gather_kv_context": (context_gather, context_gather.gather_kv_context, _gather_args,
                          _gather_changes, ("kv_cache", "new_key", "new_value", "k_scale",
                                            "v_scale", "block_table", "cu_seqlens_q",
                                            "cu_seqlens_k")),
}  # fmt: skip
# each wrapper's launchers
LAUNCHERS = {attention: ("launch_attn", "launch_merge"), cache_write: ("launch_write",),
             context_gather: ("launch_gather",)}  # fmt: skip


def test_a_swapped_config_chooser_or_write_launch_changes_the_key(monkeypatch):
    recorder = _KeyRecorder()
    monkeypatch.setattr(attention, "_replays", recorder)
    monkeypatch.setattr(cache_write, "_replays", recorder)
    for name in ("paged_attention", "write_kv_cache"):
        module, fn, make_args, *_ = CASES[name]
        fn(**make_args())
        if module is attention:  # tune_decode.py, kvbatch.force_chunked_decode
            monkeypatch.setattr(attention, "_choose_config", lambda *a, **k: None)
        else:  # test_cache_write.py's launch fixture
            monkeypatch.setattr(cache_write, "SMALL_BATCH_TOKENS", 0)
        fn(**make_args())
        assert recorder.keys[-1] != recorder.keys[-2]


def _record_swaps(monkeypatch, module, launchers) -> tuple[list[set[str]], list[list[str]]]:
    """Stand-ins for ``module``'s replay cache and for the ``(owner, attribute)`` launchers: the
    names of the (non-None) tensors each ``ReplayCache.run`` is handed, and the first argument
    name of each swap group each ``record`` gets (every name checked to be the kernel's)."""
    given: list[set[str]] = []
    swaps: list[list[str]] = []

    class _Cache:
        def run(self, key, **tensors):
            given.append({n for n, t in tensors.items() if t is not None})
            return False

    class _Launcher:
        def __init__(self, kernel):
            self.kernel = kernel

        def record(self, swap, grid, *args, **kwargs):
            names = self.kernel.arg_names
            assert all(n in names for group in swap for n in group), swap
            swaps.append([group[0] for group in swap])
            return None

    monkeypatch.setattr(module, "_replays", _Cache())
    for owner, attr in launchers:
        monkeypatch.setattr(owner, attr, _Launcher(getattr(owner, attr).fn))
    return given, swaps


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
def test_every_swapped_argument_is_one_the_replay_is_given(name, kv_dtype, monkeypatch):
    """A replay takes its tensors by the first argument name of each group ``record`` got; the
    wrapper must hand ``ReplayCache.run`` a tensor under each of those names (a missing one would
    raise on the GPU only, at the second layer)."""
    module, fn, make_args, *_ = CASES[name]
    given, swaps = _record_swaps(monkeypatch, module, [(module, a) for a in LAUNCHERS[module]])
    scales = {"k_scale": torch.ones(NKV, D), "v_scale": torch.ones(NKV, D)}
    args = {**make_args(), "kv_dtype": kv_dtype, **(scales if kv_dtype == "int8_static" else {})}
    splits = {"num_splits": 4} if module is attention else {}  # the merge's record too
    fn(**{**args, **splits})
    assert len(swaps) == (2 if module is attention else 1)
    for firsts in swaps:
        assert set(firsts) <= given[0], (firsts, given[0])


# int4 (attention_int4.py, cache_write_int4.py): the layer's own tensors are its query, output,
# cache, tail pool and tail pages (and sink pool); the batch's are the metadata and tail slots
B4 = 64


def _tail(slots: int = 4, pages: int = 1) -> torch.Tensor:
    return torch.zeros(slots, 2, NKV, B4 * pages, D, dtype=torch.bfloat16)


def _attention_int4_args():
    pages = get_page_bytes("int4", B4, NKV, D)
    q = torch.randn(4, NQ, D, dtype=torch.bfloat16)
    return dict(
        query=q, kv_cache=torch.zeros(8, pages, dtype=torch.int8), output=torch.empty_like(q),
        kv_dtype="int4", block_size=B4, num_kv_heads=NKV,
        query_start_loc=_int32(5, fill=torch.arange(5)), seq_lens=_int32(4, fill=torch.tensor(20)),
        block_table=_int32(4, 2, fill=torch.arange(8).view(4, 2)), max_query_len=1,
        max_seq_len=20, softmax_scale=0.125, tail=_tail(), tail_page=_int32(4),
        slot_of_seq=_int32(4, fill=torch.arange(4)), sliding_window=None, soft_cap=None,
        workspace=None, num_splits=None, sink=None, sink_of_seq=None,
    )  # fmt: skip


def _attention_int4_changes(a):
    return _any_attention_changes(a) | {
        "kv_dtype": ["int4_other"], "block_size": [32], "num_kv_heads": [1],
        "tail": [_tail(3), _tail(pages=2), _tail(8)[::2]],
        "tail_page": [_int32(3), _int32(4, 2), torch.zeros(8, dtype=torch.int32)[::2]],
        "slot_of_seq": [a["slot_of_seq"].clone(), a["slot_of_seq"][:3],
                        _as_int64(a["slot_of_seq"])],
        "sink": [_tail(1)], "sink_of_seq": [_int32(4)],
    }  # fmt: skip


def _write_int4_args():
    pages = get_page_bytes("int4", B4, NKV, D)
    k = torch.randn(4, NKV, D, dtype=torch.bfloat16)
    return dict(
        key=k, value=torch.randn_like(k), kv_cache=torch.zeros(8, pages, dtype=torch.int8),
        tail=_tail(), tail_page=_int32(4), block_size=B4,
        query_start_loc=_int32(5, fill=torch.arange(5)), seq_lens=_int32(4, fill=torch.tensor(20)),
        block_table=_int32(4, 2, fill=torch.arange(8).view(4, 2)),
        slot_of_seq=_int32(4, fill=torch.arange(4)), slot_is_new=_int32(4), num_seqs=4,
        max_query_len=1, kv_dtype="int4",
    )  # fmt: skip


def _write_int4_changes(a):
    k, cache = a["key"], a["kv_cache"]
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.int8)
    strided = torch.randn(4, 2 * NKV, D, dtype=k.dtype)[:, ::2]
    return {
        "key": [k[:3], strided], "value": [a["value"][:3], strided], "kv_cache": [wide[:, :-16]],
        "tail": [_tail(3), _tail(pages=2), _tail(8)[::2]],
        "tail_page": [_int32(3), _int32(4, 2), torch.zeros(8, dtype=torch.int32)[::2]],
        "block_size": [32],
        **{name: [a[name].clone(), _as_int64(a[name])] for name in ("slot_of_seq", "slot_is_new")},
        **{name: [_as_int64(a[name])] for name in ("query_start_loc", "seq_lens")},
        "block_table": [torch.zeros(4, 3, dtype=torch.int32)[:, :2], _as_int64(a["block_table"])],
        "num_seqs": [3], "max_query_len": [2], "kv_dtype": ["int4_other"],
    }  # fmt: skip


def _sink_args():
    k = torch.randn(4, NKV, D, dtype=torch.bfloat16)
    return dict(
        key=k, value=torch.randn_like(k), sink=_tail(2), sink_of_seq=_int32(4),
        query_start_loc=_int32(5, fill=torch.arange(5)), seq_lens=_int32(4, fill=torch.tensor(20)),
        num_seqs=4, block_size=B4, kv_dtype="int4",
    )  # fmt: skip


def _sink_changes(a):
    k = a["key"]
    strided = torch.randn(4, 2 * NKV, D, dtype=k.dtype)[:, ::2]
    return {
        "key": [k[:3], strided], "value": [a["value"][:3], strided],
        "sink": [_tail(3), _tail(8)[::2]],
        "sink_of_seq": [a["sink_of_seq"].clone(), a["sink_of_seq"][:3],
                        _as_int64(a["sink_of_seq"])],
        **{name: [a[name].clone(), _as_int64(a[name])] for name in ("query_start_loc", "seq_lens")},
        "num_seqs": [3], "block_size": [32], "kv_dtype": ["int4_other"],
    }  # fmt: skip


def _gather_int4_args():
    return dict(
        **_gather_batch("int4", B4), tail=_tail(), tail_page=_int32(4),
        slot_of_seq=_int32(2, fill=torch.arange(2)), sink=None, sink_of_seq=None,
    )  # fmt: skip


def _gather_int4_changes(a):
    changes = _gather_changes(a)
    for name in ("k_scale", "v_scale", "v_format"):  # int8's only
        del changes[name]
    return changes | {
        "kv_dtype": ["int4_other"], "block_size": [32],
        "tail": [_tail(3), _tail(pages=2), _tail(8)[::2]],
        "tail_page": [_int32(3), _int32(4, 2), torch.zeros(8, dtype=torch.int32)[::2]],
        "slot_of_seq": [a["slot_of_seq"].clone(), a["slot_of_seq"][:1],
                        _as_int64(a["slot_of_seq"])],
        "sink": [_tail(1)], "sink_of_seq": [_int32(4)],
    }  # fmt: skip


INT4_CASES = {
    "paged_attention_int4": (attention_int4, attention_int4.paged_attention_int4,
                             _attention_int4_args, _attention_int4_changes,
                             ("query", "output", "kv_cache", "tail", "tail_page", "sink",
                              "query_start_loc", "seq_lens", "block_table")),
    "write_kv_cache_int4": (cache_write_int4, cache_write_int4.write_kv_cache_int4,
                            _write_int4_args, _write_int4_changes,
                            ("key", "value", "kv_cache", "tail", "tail_page", "query_start_loc",
                             "seq_lens", "block_table")),
    "write_sink_int4": (cache_write_int4, cache_write_int4.write_sink_int4, _sink_args,
                        _sink_changes, ("key", "value", "sink")),
    "gather_kv_context_int4": (context_gather, context_gather.gather_kv_context_int4,
                               _gather_int4_args, _gather_int4_changes,
                               ("kv_cache", "new_key", "new_value", "tail", "tail_page", "sink",
                                "block_table", "cu_seqlens_q", "cu_seqlens_k")),
}  # fmt: skip
# each int4 wrapper's launchers, by their owning module
INT4_LAUNCHERS = {
    "paged_attention_int4": [
        (attention_int4, "launch_attn_int4"),
        (attention_plan, "launch_merge"),
    ],
    "write_kv_cache_int4": [(cache_write_int4, "launch_flush"), (cache_write_int4, "launch_tail")],
    "write_sink_int4": [(cache_write_int4, "launch_sink")],
    "gather_kv_context_int4": [(context_gather, "launch_gather_int4")],
}


@pytest.mark.parametrize("name", [*CASES, *INT4_CASES])
def test_every_argument_is_in_the_replay_key(name, monkeypatch):
    module, fn, make_args, make_changes, swapped = {**CASES, **INT4_CASES}[name]
    recorder = _KeyRecorder()
    monkeypatch.setattr(module, "_replays", recorder)
    base = make_args()
    changes = make_changes(base)
    # a parameter added later must come with a change here
    assert set(changes) == set(inspect.signature(fn).parameters), "a parameter has no change"
    fn(**base)
    for param, values in changes.items():
        for value in values:
            fn(**{**base, param: value})
            assert recorder.keys[-1] != recorder.keys[0], f"{param}: {value!r:.60} kept the key"
    # the swapped tensors' storage alone (same dtype, shape, strides) keeps the key
    fn(**{**base, **{p: base[p].clone() for p in swapped if base[p] is not None}})
    assert recorder.keys[-1] == recorder.keys[0]


@pytest.mark.parametrize(
    ("name", "sink"),
    [
        ("paged_attention_int4", False),
        ("paged_attention_int4", True),
        ("write_kv_cache_int4", False),
        ("write_sink_int4", True),
        ("gather_kv_context_int4", False),
        ("gather_kv_context_int4", True),
    ],
)
def test_every_swapped_int4_argument_is_one_the_replay_is_given(name, sink, monkeypatch):
    """As for int8: each swap group's first name among the tensors the wrapper hands the cache
    (with and without a sink pool, whose slot the tail takes when there is none)."""
    module, fn, make_args, *_ = INT4_CASES[name]
    given, swaps = _record_swaps(monkeypatch, module, INT4_LAUNCHERS[name])
    args = make_args()
    if module is attention_int4:
        args["num_splits"] = 4  # the merge's record too
    if sink and module in (attention_int4, context_gather):
        args |= {"sink": _tail(1), "sink_of_seq": _int32(4)}
    fn(**args)
    assert len(swaps) == len(INT4_LAUNCHERS[name])
    for firsts in swaps:
        assert set(firsts) <= given[0], (firsts, given[0])


@pytest.mark.parametrize("name", ["paged_attention", "paged_attention_int4"])
def test_a_given_split_count_leaves_the_longest_sequence_out_of_the_key(name, monkeypatch):
    """max_seq_len only picks the split count: with num_splits given (the shim always gives it)
    the next step's longer sequences keep the key, so its first layer replays too."""
    module, fn, make_args, *_ = {**CASES, **INT4_CASES}[name]
    recorder = _KeyRecorder()
    monkeypatch.setattr(module, "_replays", recorder)
    base = {**make_args(), "num_splits": 2}
    fn(**base)
    fn(**{**base, "max_seq_len": 4096})
    assert recorder.keys[-1] == recorder.keys[0]
    fn(**{**base, "num_splits": None})
    fn(**{**base, "num_splits": None, "max_seq_len": 4096})
    assert recorder.keys[-1] != recorder.keys[-2]

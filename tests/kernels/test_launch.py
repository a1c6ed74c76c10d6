"""DirectLauncher: the cached-binary launch must run exactly what ``kernel[grid](...)`` would.

CPU: the caching logic against a stand-in kernel (the interpreter has no binaries). GPU: real
kernels launched both ways give bit-identical outputs, and the cached path is the one taken.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvbatch import make_batch, make_cache, run_attention

import int8kv_kernels.launch as launch
from int8kv_kernels.attention import launch_attn, launch_merge
from int8kv_kernels.cache_write import launch_write
from int8kv_kernels.launch import DirectLauncher, ReplayCache


class _Kernel:
    """Stands in for a CompiledKernel: records its launches."""

    def __init__(self, spec):
        self.spec, self.function, self.packed_metadata, self.launches = spec, object(), object(), []

    def run(self, *args):
        self.launches.append(args)


class _Jit:
    """Stands in for a JITFunction: a binder specializing ints as Triton does (1, %16), and a
    run() that 'compiles' one _Kernel per specialization. ``pointer``: the name of its first
    (pointer) argument; ``any_alignment``: whether that argument is in the kernel's
    do_not_specialize_on_alignment."""

    def __init__(self, pointer: str = "x", any_alignment: bool = False):
        self.arg_names = [pointer, "n", "BLOCK"]
        self.params = [SimpleNamespace(do_not_specialize_on_alignment=any_alignment),
                       *[SimpleNamespace(do_not_specialize_on_alignment=False)] * 2]  # fmt: skip
        self.device_caches = {0: (None, None, None, None, self._bind)}
        self.compiled: list[_Kernel] = []
        self.indexed: list[tuple] = []
        self.queued: list[tuple] = []  # run(warmup=True): compiled, not launched

    def _bind(self, x, n, BLOCK=None, **options):
        spec = [
            ("*fp32", "" if self.params[0].do_not_specialize_on_alignment else "D"),
            ("constexpr", 1) if n == 1 else ("i32", "D" if n % 16 == 0 else ""),
        ]
        return (
            {self.arg_names[0]: x, "n": n, "BLOCK": BLOCK},
            [*spec, ("constexpr", BLOCK)],
            options,
        )

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            self.queued.append((grid, args, kwargs))
            return None
        kernel = _Kernel(self._bind(*args, **kwargs)[1])
        self.compiled.append(kernel)
        return kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.indexed.append((grid, args, kwargs))


class _CudaArg:
    device = torch.device("cuda", 0)
    is_cuda = True
    dtype = torch.float32

    def __init__(self, address: int = 4096):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda index: 1234)
    jit = _Jit()
    launcher = DirectLauncher(jit)
    launcher.direct = True  # a stand-in is not a JITFunction
    return jit, launcher


def test_second_launch_of_a_specialization_uses_the_cached_binary(fake):
    jit, launcher = fake
    x = _CudaArg()
    launcher((3, 2), x, 32, BLOCK=64, num_warps=4)
    assert len(jit.compiled) == 1 and not jit.compiled[0].launches  # run() launched it
    launcher((5,), x, 48, BLOCK=64, num_warps=4)  # 48 % 16 == 0: same specialization
    (kernel,) = jit.compiled
    (args,) = kernel.launches
    assert args[:9] == (5, 1, 1, 1234, kernel.function, kernel.packed_metadata, None, None, None)
    # every parameter in signature order, as run() passes them; tensors as their addresses
    assert args[9:] == (4096, 48, 64)
    assert launcher.direct_launches == 1


def test_a_cached_launch_with_a_non_cuda_pointer_goes_through_triton(fake):
    jit, launcher = fake
    launcher((1,), _CudaArg(), 32, BLOCK=64)
    launcher((1,), _CudaArg(), 32, BLOCK=64)
    (kernel,) = jit.compiled
    assert len(kernel.launches) == 1 and not jit.indexed

    class _Misplaced(_CudaArg):  # passes the first-argument check, fails the per-pointer one
        is_cuda = False

    class _NotATensor:  # on the GPU by its device, but not a torch tensor
        device = torch.device("cuda", 0)

    launcher((1,), _Misplaced(), 32, BLOCK=64)
    launcher((1,), _NotATensor(), 32, BLOCK=64)
    assert len(kernel.launches) == 1 and len(jit.indexed) == 2


@pytest.mark.parametrize(
    "change",
    [
        dict(n=33),  # not a multiple of 16
        dict(n=1),  # Triton makes 1 a constant
        dict(BLOCK=128),  # another constexpr
        dict(num_warps=8),  # another launch option
    ],
)
def test_any_change_of_specialization_or_options_compiles_again(fake, change):
    jit, launcher = fake
    base = dict(n=32, BLOCK=64, num_warps=4)
    launcher((1,), _CudaArg(), **base)
    launcher((1,), _CudaArg(), **{**base, **change})
    assert len(jit.compiled) == 2
    assert not any(k.launches for k in jit.compiled)


def test_cpu_tensors_launch_hooks_and_disabled_go_through_triton(fake, monkeypatch):
    jit, launcher = fake
    launcher((2,), torch.zeros(1), 32, BLOCK=64)  # interpreter / CPU
    launcher.direct = False
    launcher((2,), _CudaArg(), 32, BLOCK=64)
    launcher.direct = True
    launch.set_direct_launches(False)  # INT8KV_DIRECT_LAUNCH=0
    try:
        launcher((2,), _CudaArg(), 32, BLOCK=64)
    finally:
        launch.set_direct_launches(True)
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)  # e.g. proton profiling
    launcher((2,), _CudaArg(), 32, BLOCK=64)
    assert len(jit.indexed) == 4 and not jit.compiled


def test_a_replay_relaunches_the_recorded_binary_with_the_swapped_tensor(fake, monkeypatch):
    jit, launcher = fake
    launcher((3, 2), _CudaArg(), 48, BLOCK=64)  # compiles
    replay = launcher.record([("x",)], (3, 2), _CudaArg(), 48, BLOCK=64)  # the cached binary
    (kernel,) = jit.compiled
    monkeypatch.setattr(launch, "_current_stream", lambda index: 99)  # replays ask for it anew
    replay.launch(replay.bind({"x": _CudaArg(8192)}))
    assert kernel.launches[-1] == (3, 2, 1, 99, kernel.function, kernel.packed_metadata, None,
                                   None, None, 8192, 48, 64)  # fmt: skip
    assert launcher.direct_launches == 2 and launcher.replays == 1


class _Half(_CudaArg):
    dtype = torch.float16


def test_a_replay_takes_any_address_where_the_kernel_does_not_specialize_on_alignment(monkeypatch):
    """The batch metadata (block table, query starts, lengths) is sliced per step at any row: a
    kernel compiled without alignment specialization for it replays with any address."""
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda index: 7)
    launcher = DirectLauncher(_Jit(any_alignment=True))
    launcher.direct = True  # a stand-in is not a JITFunction
    launcher.record([("x",)], (1,), _CudaArg(), 32, BLOCK=64)  # compiles
    replay = launcher.record([("x",)], (1,), _CudaArg(4100), 32, BLOCK=64)
    for address in (4096, 4100, 8196):
        assert replay.bind({"x": _CudaArg(address)}) is not None
    assert replay.bind({"x": _Half()}) is None  # the dtype still decides


def test_a_replay_refuses_tensors_its_binary_does_not_fit(fake, monkeypatch):
    jit, launcher = fake
    launcher.record([("x",)], (1,), _CudaArg(), 32, BLOCK=64)  # compiles
    replay = launcher.record([("x",)], (1,), _CudaArg(), 32, BLOCK=64)
    assert replay.bind({"x": _CudaArg(4096 + 512)}) is not None

    class _Host(_CudaArg):
        is_cuda = False

    misaligned = _CudaArg(4100)  # Triton specialized x on a multiple of 16 ("D")
    for tensor in (_Half(), _Host(), misaligned):
        assert replay.bind({"x": tensor}) is None
    launcher.direct = False
    assert replay.bind({"x": _CudaArg()}) is None
    launcher.direct = True
    launch.set_direct_launches(False)
    try:
        assert replay.bind({"x": _CudaArg()}) is None
    finally:
        launch.set_direct_launches(True)
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)
    assert replay.bind({"x": _CudaArg()}) is None
    monkeypatch.undo()
    monkeypatch.setattr(launch, "_current_device", lambda: 1)
    assert replay.bind({"x": _CudaArg()}) is None


def test_replay_cache_launches_all_of_an_entry_or_nothing(fake):
    jit, launcher = fake
    jit_y = _Jit("y")  # a second kernel, whose pointer argument is named y
    launcher_y = DirectLauncher(jit_y)
    launcher_y.direct = True
    for lau in (launcher, launcher_y):
        lau((1,), _CudaArg(), 32, BLOCK=64)  # compiles
    first = launcher.record([("x",)], (1,), _CudaArg(), 32, BLOCK=64)
    second = launcher_y.record([("y",)], (2,), _CudaArg(), 32, BLOCK=64)
    kernels = [*jit.compiled, *jit_y.compiled]
    cache = ReplayCache(max_entries=2)
    cache.add("k", [first, second])
    before = [len(k.launches) for k in kernels]
    assert not cache.run("other", x=_CudaArg(), y=_CudaArg())
    assert not cache.run("k", x=_CudaArg(), y=_CudaArg(4100))  # y does not fit: neither runs
    assert [len(k.launches) for k in kernels] == before
    assert cache.run("k", x=_CudaArg(1024), y=_CudaArg(2048))
    assert [(k.launches[-1][0], k.launches[-1][9]) for k in kernels] == [(1, 1024), (2, 2048)]
    assert [len(k.launches) for k in kernels] == [b + 1 for b in before]
    cache.add("k2", [])
    cache.add("k3", [])  # full: emptied first
    assert not cache.run("k", x=_CudaArg(), y=_CudaArg())


@pytest.mark.skipif(not launch._TRITON_OK, reason="compile_in_parallel needs Triton 3.6")
def test_inside_compile_in_parallel_a_launch_queues_its_compile_and_launches_nothing(fake):
    jit, launcher = fake
    with launch.compile_in_parallel(2):
        assert launch._compiling_only()
        launcher((3,), _CudaArg(), 32, BLOCK=64, num_warps=4)
    assert not launch._compiling_only()
    assert [(g, kw) for g, _, kw in jit.queued] == [((3,), {"BLOCK": 64, "num_warps": 4})]
    assert not jit.compiled and not jit.indexed and launcher.direct_launches == 0
    launcher((3,), _CudaArg(), 32, BLOCK=64, num_warps=4)  # afterwards: launched as usual
    assert len(jit.compiled) == 1 and len(jit.queued) == 1


def test_compile_in_parallel_with_one_thread_launches_as_usual(fake):
    jit, launcher = fake
    with launch.compile_in_parallel(1):
        assert not launch._compiling_only()
        launcher((3,), _CudaArg(), 32, BLOCK=64)
    assert len(jit.compiled) == 1 and not jit.queued


def test_every_kernel_launcher_is_found_and_interpreted_ones_never_launch_directly():
    launchers = launch.kernel_launchers()
    # attention, merge, write, gather, and int4's attention, page flush, tail store, sink store
    # and gather
    assert len({id(x) for x in launchers}) == 9
    if not torch.cuda.is_available():  # TRITON_INTERPRET=1: the kernels are InterpretedFunctions
        assert not any(x.direct for x in launchers)


@pytest.mark.gpu
def test_direct_launches_match_triton_launches_gpu(monkeypatch):
    nq, nkv, d, bs = 8, 2, 128, 16
    b = make_batch([1, 1, 1, 7], [300, 40, 1000, 77], nq, d, bs, "cuda")
    cache, _, _ = make_cache("int8", bs, nkv, d, b.num_blocks, "cuda")
    args = dict(kv_dtype="int8", block_size=bs, nkv=nkv)
    assert launch_attn.direct, "Triton is not the supported release: direct launches are off"
    for splits in (1, 4):  # 4: the merge kernel too
        first = run_attention(b, cache, **args, num_splits=splits)  # compiles (or is cached)
        before = launch_attn.direct_launches
        cached = run_attention(b, cache, **args, num_splits=splits)  # the cached binary
        # one attention launch per call; the split count is not part of the specialization, so
        # the second loop's first call may already be a cached launch: count only this one
        assert launch_attn.direct_launches - before == 1, "the cached path was not taken"
        monkeypatch.setattr(launch_attn, "direct", False)
        plain = run_attention(b, cache, **args, num_splits=splits)  # kernel[grid](...)
        monkeypatch.undo()
        assert torch.equal(first, cached) and torch.equal(first, plain)


@pytest.mark.gpu
def test_direct_cache_writes_match_triton_launches_gpu(monkeypatch):
    from int8kv_kernels import get_page_bytes, write_kv_cache

    nkv, d, bs, n = 4, 128, 16, 300
    key = torch.randn(n, nkv, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(64 * bs, device="cuda")[:n]
    pages = get_page_bytes("int8", bs, nkv, d)
    caches, launched = [], []
    for direct in (True, True, False):  # compile (or cached), cached binary, kernel[grid](...)
        monkeypatch.setattr(launch_write, "direct", direct)
        cache = torch.zeros(64, pages, dtype=torch.int8, device="cuda")
        before = launch_write.direct_launches
        write_kv_cache(key, value, cache, slots, kv_dtype="int8", block_size=bs)
        launched.append(launch_write.direct_launches - before)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])
    assert launched[1:] == [1, 0], launched


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "int8_static"])
@pytest.mark.parametrize("splits", [1, 4])  # 4: the merge kernel is replayed too
def test_replays_across_layers_match_triton_launches_gpu(kv_dtype, splits, monkeypatch):
    """Layers of one step: the same batch metadata, each layer with its own query, cache, output
    and static scales. From the second layer on the launches are replays (paged_attention,
    write_kv_cache); every output equals a plain ``kernel[grid]`` launch's."""
    from dataclasses import replace

    from int8kv_kernels import make_workspace, write_kv_cache

    nq, nkv, d, bs = 8, 2, 128, 16
    b = make_batch([1, 1, 1, 1], [300, 40, 1000, 77], nq, d, bs, "cuda")
    ws = make_workspace(8, nq, d, device="cuda")
    layers = [(make_cache(kv_dtype, bs, nkv, d, b.num_blocks, "cuda"),
               torch.randn_like(b.query)) for _ in range(3)]  # fmt: skip
    slots = torch.randperm(b.num_blocks * bs, device="cuda")[:64]
    kv = torch.randn(64, nkv, d, device="cuda", dtype=torch.bfloat16)

    def step():
        outs = []
        for (cache, k_scale, v_scale), q in layers:
            write_kv_cache(kv, kv * 0.5, cache, slots, kv_dtype=kv_dtype, block_size=bs,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            outs.append(run_attention(replace(b, query=q), cache, kv_dtype=kv_dtype,
                                      block_size=bs, nkv=nkv, k_scale=k_scale, v_scale=v_scale,
                                      workspace=ws, num_splits=splits))  # fmt: skip
        return outs, [c.clone() for (c, _, _), _ in layers]

    step()  # compiles, records
    attn0, write0 = launch_attn.replays, launch_write.replays
    outs, caches = step()  # every launch a replay
    assert launch_attn.replays - attn0 == len(layers)
    assert launch_write.replays - write0 == len(layers)
    for launcher in (launch_attn, launch_write, launch_merge):
        monkeypatch.setattr(launcher, "direct", False)
    plain_outs, plain_caches = step()
    for x, y in zip(outs + caches, plain_outs + plain_caches, strict=True):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])  # 4: the merge kernel is replayed too
def test_replays_take_each_groups_block_table_and_each_steps_metadata_gpu(splits, monkeypatch):
    """Gemma 3's layers as vLLM runs them: several KV-cache groups, each with its own block
    table, and a mixed batch's metadata sliced anew every step. Only the first layer of the first
    step launches through the binder; the rest replay with their own block table and the step's
    metadata, and every output equals a plain ``kernel[grid]`` launch's."""
    from dataclasses import replace

    from int8kv_kernels import make_workspace

    nq, nkv, d, bs = 8, 2, 128, 16
    b = make_batch([1, 1, 1, 1], [300, 40, 1000, 77], nq, d, bs, "cuda")
    ws = make_workspace(8, nq, d, device="cuda")
    cache = make_cache("int8", bs, nkv, d, b.num_blocks, "cuda")[0]
    # every group's table a permutation of the blocks: each reads other pages
    tables = [torch.randperm(b.num_blocks, device="cuda").to(torch.int32)[b.block_table.long()]
              for _ in range(3)]  # fmt: skip
    queries = [torch.randn_like(b.query) for _ in tables]

    def step():
        # fresh metadata tensors, as a mixed batch's rows are sliced every step
        meta = dict(query_start_loc=b.query_start_loc.clone(), seq_lens=b.seq_lens.clone())
        return [run_attention(replace(b, query=q, block_table=t.clone(), **meta), cache,
                              kv_dtype="int8", block_size=bs, nkv=nkv, workspace=ws,
                              num_splits=splits)
                for q, t in zip(queries, tables, strict=True)]  # fmt: skip

    step()  # compiles, records the first layer
    attn0 = launch_attn.replays
    outs = step()  # every launch a replay
    assert launch_attn.replays - attn0 == len(tables)
    for launcher in (launch_attn, launch_merge):
        monkeypatch.setattr(launcher, "direct", False)
    plain = step()
    for x, y in zip(outs, plain, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(outs[0], outs[1])  # the groups did read their own pages


def test_launch_hooks_count_only_when_a_hook_is_registered():
    import triton

    chain = triton.knobs.runtime.launch_enter_hook
    assert not launch._launch_hooks_set()  # Triton's empty chains

    def hook(metadata):
        pass

    chain.add(hook)
    try:
        assert launch._launch_hooks_set()
    finally:
        chain.remove(hook)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 1, 20, 7]])  # decodes; a mixed batch
@pytest.mark.parametrize("sinks", [False, True])
def test_int4_replays_across_layers_match_triton_launches_gpu(q_lens, sinks, monkeypatch):
    """int4's write (page flush + tail store, and the sink write) and attention, layers of one
    step as vLLM runs them: the same batch metadata, tail slots and sinks, each layer with its own
    cache, tail pool, tail pages, sink pool, new K/V and query. In the second step every launch is
    a replay; the caches, tails, sinks and outputs equal plain ``kernel[grid]`` launches' bit for
    bit."""
    from int8kv_kernels import Int4PageLayout, make_workspace, paged_attention_int4
    from int8kv_kernels.attention_int4 import launch_attn_int4
    from int8kv_kernels.cache_write_int4 import (
        launch_flush,
        launch_sink,
        launch_tail,
        write_kv_cache_int4,
        write_sink_int4,
    )

    torch.manual_seed(3)
    nq, nkv, d, bs, slots = 8, 2, 64, 64, 6
    b = make_batch(q_lens, [71, 71, 130, 64], nq, d, bs, "cuda")
    page_bytes = Int4PageLayout(bs, nkv, d).page_bytes
    n = b.query.shape[0]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    slot_of_seq, slot_is_new = i32([0, 1, 2, 3]), i32([0, 1, 0, 1])
    sink_of_seq = i32([1, -1, 0, 2]) if sinks else None
    ws = make_workspace(8, nq, d, device="cuda")
    layers = [dict(cache=torch.randint(-128, 128, (b.num_blocks, page_bytes), dtype=torch.int8,
                                       device="cuda"),
                   tail=torch.randn(slots, 2, nkv, bs, d, device="cuda").bfloat16(),
                   tail_page=i32([-1] * slots), query=torch.randn_like(b.query),
                   sink=torch.randn(3, 2, nkv, bs, d, device="cuda").bfloat16(),
                   k=torch.randn(n, nkv, d, device="cuda").bfloat16(),
                   v=torch.randn(n, nkv, d, device="cuda").bfloat16()) for _ in range(3)]  # fmt: skip
    state = ("cache", "tail", "tail_page", "sink")
    start = [{name: x[name].clone() for name in state} for x in layers]

    def step():
        outs = []
        for layer, first in zip(layers, start, strict=True):
            for name, t in first.items():  # every step from the same state
                layer[name].copy_(t)
            meta = dict(block_size=bs, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                        block_table=b.block_table)  # fmt: skip
            write_kv_cache_int4(layer["k"], layer["v"], layer["cache"], layer["tail"],
                                layer["tail_page"], slot_of_seq=slot_of_seq,
                                slot_is_new=slot_is_new, num_seqs=len(q_lens),
                                max_query_len=b.max_query_len, **meta)  # fmt: skip
            sink = layer["sink"] if sinks else None
            if sinks:
                write_sink_int4(layer["k"], layer["v"], sink, sink_of_seq,
                                query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                                num_seqs=len(q_lens))  # fmt: skip
            out = torch.full_like(layer["query"], float("nan"))
            paged_attention_int4(layer["query"], layer["cache"], out, num_kv_heads=nkv,
                                 max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
                                 softmax_scale=d**-0.5, tail=layer["tail"],
                                 tail_page=layer["tail_page"], slot_of_seq=slot_of_seq,
                                 workspace=ws, num_splits=4, sink=sink, sink_of_seq=sink_of_seq,
                                 **meta)  # fmt: skip
            outs += [out, *(layer[name].clone() for name in state)]
        return outs

    step()  # compiles, records
    launchers = (launch_attn_int4, launch_flush, launch_tail, launch_sink)
    before = [x.replays for x in launchers]
    outs = step()  # every launch a replay
    launched = [x.replays - y for x, y in zip(launchers, before, strict=True)]
    assert launched == [3, 3, 3, 3 if sinks else 0]
    for launcher in (*launchers, launch_merge):
        monkeypatch.setattr(launcher, "direct", False)
    plain = step()
    for x, y in zip(outs, plain, strict=True):
        assert torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan())

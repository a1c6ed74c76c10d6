"""The start-up warm-up compiles every kernel variant serving batches launch (as Triton's binder
decides variants for an sm80 target), so none compiles mid-serving; and it runs once per shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from int8kv_shim import kernel_warmup

PROBE = Path(__file__).with_name("warmup_variants.py")

SHAPES = {
    "SmolLM2 9/3/64": dict(kv_dtype="int8", heads=9, kv_heads=3, head_size=64, window=None,
                           v_format="int8", gather=True),
    "Gemma 3 4/1/256, sliding": dict(kv_dtype="int8", heads=4, kv_heads=1, head_size=256,
                                     window=512, v_format="int8", gather=True),
    "int8_static e4m3 32/8/128": dict(kv_dtype="int8_static", heads=32, kv_heads=8,
                                      head_size=128, window=None, v_format="e4m3", gather=False),
}  # fmt: skip
# int4 (64-token pages, a tail pool) at the same head shapes
_INT4 = dict(kv_dtype="int4", v_format="int8")
SHAPES |= {
    "int4 SmolLM2 9/3/64": SHAPES["SmolLM2 9/3/64"] | _INT4,
    "int4 Gemma 3 4/1/256, sliding": SHAPES["Gemma 3 4/1/256, sliding"] | _INT4,
    "int4 32/8/128": SHAPES["int8_static e4m3 32/8/128"] | _INT4,
}
# and as int4 ships: a tail of two pages and a sink page (INT8KV_INT4_TAIL_PAGES=2,
# INT8KV_INT4_SINK_PAGE=1); the shapes above keep one tail page and no sink page
SHAPES |= {
    f"{name}, two tail pages and a sink page": SHAPES[name] | {"tail_pages": 2, "sink": True}
    for name in ("int4 Gemma 3 4/1/256, sliding", "int4 32/8/128")
}
KERNELS = {
    "int8": {"_attn_fwd", "merge_splits", "_write_kv_kernel"},
    "int4": {"_attn_int4_fwd", "merge_splits", "_flush_pages_kernel", "_store_tail_kernel"},
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_warmup_compiles_every_variant_serving_batches_launch(name: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JITFunctions
    shape = SHAPES[name]
    env["INT8KV_INT4_TAIL_PAGES"] = str(shape.get("tail_pages", 1))
    env["INT8KV_INT4_SINK_PAGE"] = "1" if shape.get("sink") else "0"
    shape = {**shape, "block_size": 64 if shape["kv_dtype"] == "int4" else 16}
    proc = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(shape)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    warm = set(found["warmup"])
    kernels = {eval(k)[0] for k in warm}  # noqa: S307  (our own repr of tuples of literals)
    expected = KERNELS["int4" if shape["kv_dtype"] == "int4" else "int8"]
    expected = expected | ({"_store_sink_kernel"} if shape.get("sink") else set())
    gather = "_gather_int4_kernel" if shape["kv_dtype"] == "int4" else "_gather_kv_kernel"
    assert expected | ({gather} if shape["gather"] else set()) == kernels
    missing = {
        batch: [k for k in keys if k not in warm]
        for batch, keys in found["serving"].items()
        if not set(keys) <= warm
    }
    assert all(found["serving"].values()), "a serving batch launched nothing: the probe is broken"
    assert not missing, f"variants serving compiles mid-run: {missing}"


def _impl(**kw) -> SimpleNamespace:
    base = dict(
        kv_cache_dtype="int8", num_heads=4, num_kv_heads=1, head_size=256, sliding_window=None,
        logits_soft_cap=None, v_format="int8", flash_prefill=True, scale=0.0625, k_scale=None,
        v_scale=None,
    )  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_warmup_runs_once_per_layer_shape(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(kernel_warmup, "_warmed", set())
    monkeypatch.setattr(kernel_warmup, "_launch_all", lambda key, *a: calls.append(key) or 3)
    cpu = torch.device("cpu")
    kw = dict(block_size=16, model_dtype=torch.bfloat16, device=cpu)
    assert kernel_warmup.warm_up_layer(_impl(), **kw) == 3
    assert kernel_warmup.warm_up_layer(_impl(), **kw) == 0  # the same shape: nothing to compile
    assert kernel_warmup.warm_up_layer(_impl(sliding_window=512), **kw) == 3
    assert kernel_warmup.warm_up_layer(_impl(), **(kw | {"block_size": 32})) == 3
    int4 = kw | {"block_size": 64}
    assert kernel_warmup.warm_up_layer(_impl(kv_cache_dtype="int4"), **int4) == 3
    assert kernel_warmup.warm_up_layer(_impl(kv_cache_dtype="int4"), **int4) == 0
    assert [(k.kv_dtype, k.sliding_window, k.gather) for k in calls] == [
        ("int8", None, True), ("int8", 512, True), ("int8", None, True), ("int4", None, True),
    ]  # fmt: skip


@pytest.mark.parametrize("threads", [1, 3])
def test_on_a_gpu_the_warmup_compiles_every_new_shape_in_parallel_first(monkeypatch, threads):
    from int8kv_kernels import launch

    calls = []
    monkeypatch.setattr(kernel_warmup, "_warmed", set())
    monkeypatch.setenv("INT8KV_COMPILE_THREADS", str(threads))
    monkeypatch.setattr(launch, "_TRITON_OK", True)  # so that the block compiles in parallel
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(kernel_warmup, "_launch_all",
                        lambda key, *a: calls.append((key.sliding_window,
                                                      launch._compiling_only())) or 3)  # fmt: skip
    kw = dict(block_size=16, model_dtype=torch.bfloat16, device=torch.device("cuda"))
    kernel_warmup.warm_up_layers([_impl()], **kw)  # warmed: skipped by the next call's pass
    calls.clear()
    impls = [_impl(), _impl(sliding_window=512), _impl(sliding_window=512)]
    assert kernel_warmup.warm_up_layers(impls, **kw) == 3
    parallel = [(512, True)] if threads > 1 else []
    assert calls == parallel + [(512, False)]


# two writes; one decode token at every split count; two tokens split and not; a prefill chunk
# split and not; the context gather
_LAUNCHES = 2 + len(kernel_warmup._SPLIT_COUNTS) + 2 + 2 + 1


@pytest.mark.parametrize(
    "kv_dtype, block_size, launches",
    [("int8", 16, _LAUNCHES), ("int4", 64, _LAUNCHES + 1)],  # int4: + its sink page store
)
def test_warmup_launches_run_on_the_interpreter(
    kv_dtype: str, block_size: int, launches: int
) -> None:
    # the real launches, tiny: every argument the warm-up passes is one the wrappers accept
    impl = _impl(kv_cache_dtype=kv_dtype, head_size=64)
    kernel_warmup._warmed.discard(kernel_warmup.layer_key(impl, block_size, torch.bfloat16))
    n = kernel_warmup.warm_up_layer(
        impl, block_size=block_size, model_dtype=torch.bfloat16, device=torch.device("cpu")
    )
    assert n == launches


def _compiled_binaries() -> dict[str, int]:
    """How many binaries each of our directly launched kernels holds in this process."""
    from int8kv_kernels.launch import kernel_launchers

    return {
        v.fn.__name__: sum(len(c[0]) for c in v.fn.device_caches.values())
        for v in kernel_launchers() if v.direct
    }  # fmt: skip


@pytest.mark.gpu
def test_the_parallel_compiles_build_every_variant_the_warmup_launches_gpu(monkeypatch) -> None:
    from int8kv_kernels.launch import compile_in_parallel

    # a shape no other test warms: every variant is new to this process
    impl = _impl(kv_cache_dtype="int4", num_heads=6, num_kv_heads=2, head_size=128,
                 sliding_window=320)  # fmt: skip
    key = kernel_warmup.layer_key(impl, 64, torch.bfloat16)
    device = torch.device("cuda")
    before = _compiled_binaries()
    with compile_in_parallel(4):
        kernel_warmup._launch_all(key, impl.scale, None, None, device)
    compiled = _compiled_binaries()
    assert compiled != before, "nothing was compiled"
    kernel_warmup._launch_all(key, impl.scale, None, None, device)
    torch.cuda.synchronize()
    assert _compiled_binaries() == compiled, "the launches compiled variants the pass left out"


def _record_int4_launches(monkeypatch) -> list[tuple[str, dict]]:
    """The warm-up's int4 launches, recorded (name, keyword arguments) instead of run, on a
    warm-up that has warmed nothing yet."""
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(kernel_warmup, "_warmed", set())
    for name in ("paged_attention", "write_kv_cache", "write_sink_int4"):
        monkeypatch.setattr(kernel_warmup, name,
                            lambda *a, _n=name, **kw: calls.append((_n, kw)))  # fmt: skip
    return calls


def test_int4_with_sink_pages_warms_their_store_and_the_attention_that_reads_them(
    monkeypatch,
) -> None:
    calls = _record_int4_launches(monkeypatch)
    impl = _impl(kv_cache_dtype="int4", num_heads=4, num_kv_heads=2, head_size=64)
    kw = dict(block_size=64, model_dtype=torch.bfloat16, device=torch.device("cpu"))
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "0")
    launches = kernel_warmup.warm_up_layer(impl, **kw)
    assert "write_sink_int4" not in [n for n, _ in calls]
    assert all("sink" not in c for n, c in calls if n == "paged_attention")
    calls.clear()
    monkeypatch.setattr(kernel_warmup, "_warmed", set())
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    assert kernel_warmup.warm_up_layer(impl, **kw) == launches + 1
    assert [n for n, _ in calls].count("write_sink_int4") == 1
    attention = [c for n, c in calls if n == "paged_attention"]
    assert attention and all(c["sink"].shape == (1, 2, 2, 64, 64) for c in attention)
    assert all(c["sink_of_seq"] is c["slot_of_seq"] for c in attention)


def test_int4_with_two_tail_pages_warms_the_two_page_variants(monkeypatch) -> None:
    calls = _record_int4_launches(monkeypatch)
    impl = _impl(kv_cache_dtype="int4", num_heads=4, num_kv_heads=2, head_size=64)
    kw = dict(block_size=64, model_dtype=torch.bfloat16, device=torch.device("cpu"))
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "1")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "0")
    launches = kernel_warmup.warm_up_layer(impl, **kw)
    assert all(c["tail"].shape == (1, 2, 2, 64, 64) and c["tail_page"].shape == (1,)
               for n, c in calls if n != "write_sink_int4")  # fmt: skip
    calls.clear()
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "2")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "1")
    # another key: a process warming both pools' layers compiles both
    assert kernel_warmup.warm_up_layer(impl, **kw) == launches + 1
    tails = [c for n, c in calls if n != "write_sink_int4"]
    assert tails and all(c["tail"].shape == (1, 2, 2, 128, 64) for c in tails)
    assert all(c["tail_page"].shape == (1, 2) for c in tails)
    attention = [c for n, c in calls if n == "paged_attention"]
    assert all(c["sink"].shape == (1, 2, 2, 64, 64) for c in attention)

"""Host time of the attention path per vLLM step, on a CPU: our metadata builder (once a step) and
the impl's ``do_kv_cache_update`` / ``forward`` (once a layer), with every kernel launch and the
FlashAttention-2 call replaced by no-ops, so what is timed is our Python and the torch ops it
dispatches.

SmolLM2-135M's attention (9 query / 3 KV heads, head size 64, 30 layers; block size 16 for
``int8``, 64 for ``int4``) on three batches of vLLM's model runner V2 (decodes first): 32 decodes;
31 decodes + a 2048-token first chunk; 31 decodes + a 2048-token chunk over 5888 cached tokens
(the context gather + FlashAttention-2 path of flash_prefill.py; ``int4``'s chunk ran on our
kernels until 2026-12-06, as in the committed results).
``int4``'s tail slots and sink rows are assigned as the model runner's hooks assign them
(``assign_rows``): of the three batches only ``mixed``'s first chunk writes its sink page.
Every step empties the kernels' replay caches first (the worst case: a batch whose shape changed),
so layer 1 runs each wrapper whole and records its launches, layers 2-30 replay what they can, as
on a GPU; the replays are stand-ins with the real ones' host checks minus the CUDA ones.
``--groups N`` splits the layers into N KV-cache groups, each with its own block table and slot
mapping, built as vLLM's model runner does (one build, then ``update_block_table`` for every other
group; Gemma 3 270M has six groups of three layers). Each launch that is not a replay also runs
Triton's binder, built for an sm80 target (what ``DirectLauncher`` runs on a GPU host before its
launch); ``--no-binder`` leaves it out.

Per call: the median over ``--steps`` steps of the builder's µs, of the first layer's and of the
other layers' forward and update µs, and the aten ops each dispatched (TorchDispatchMode, views
included); launches and replays per step. ``--check-syncs`` also runs every batch once with the
device tensors on torch's ``meta`` device, where any read of a device value on the host (``.item()``,
``.tolist()``, ``nonzero``, a boolean mask, ...) raises, which on CUDA would be a GPU sync:

    CUDA_VISIBLE_DEVICES= python -m benchmarks.host_overhead --check-syncs --out host_overhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS_DIR, shim_switches, write_json
from int8kv_kernels.launch import clear_replays

NQ, NKV, D, LAYERS = 9, 3, 64, 30
BLOCK_SIZES = {"int8": 16, "int4": 64}
NUM_REQS, CONTEXT, CHUNK, CACHED = 32, 7936, 2048, 5888
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 64
BATCHES = ("decode", "mixed", "gather")


class Launches:
    """Stand-ins for ``DirectLauncher._launch`` and ``Replay``: count, bind, launch nothing."""

    def __init__(self, binder: bool) -> None:
        self.binder = binder
        self.counts: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()  # launches and replays by kernel name (tests)
        self._binders: dict[int, Callable[..., Any]] = {}

    def install(self) -> None:
        from int8kv_kernels import launch

        stand_in = self

        class StandInReplay(launch.Replay):
            def bind(self, tensors: dict[str, torch.Tensor]) -> list | None:
                # Replay.bind's checks but the CUDA ones (device, is_cuda)
                return self.swapped(tensors, on_cuda=False)

            def launch(self, values: list) -> None:
                stand_in.counts["replays"] += 1
                stand_in.kernels[self.launcher.fn.__name__] += 1

        def run(launcher: Any, grid: Any, args: tuple, kwargs: dict, swap: Any) -> Any:
            self.counts["launches"] += 1
            self.kernels[launcher.fn.__name__] += 1
            if self.binder and args[0].device.type != "meta":
                self._bind(launcher.fn, args, kwargs)
            if swap is None:
                return None
            names = launcher.fn.arg_names
            slots = []
            for g in swap:
                positions = tuple(names.index(n) for n in g)
                # as DirectLauncher.record: None where the kernel takes any alignment; the
                # tensors here are taken as aligned where it specializes
                free = launch.takes_any_alignment(launcher.fn, positions)
                slots.append((g[0], positions, args[positions[0]].dtype, None if free else True))
            return StandInReplay(launcher, None, (*grid, 1, 1)[:3], 0, list(args), tuple(slots))

        launch.DirectLauncher._launch = run  # type: ignore[method-assign]

    def _bind(self, fn: Any, args: tuple, kwargs: dict) -> None:
        binder = self._binders.get(id(fn))
        if binder is None:
            from triton.backends.compiler import GPUTarget
            from triton.backends.nvidia.compiler import CUDABackend
            from triton.runtime.jit import create_function_from_signature

            backend = CUDABackend(GPUTarget("cuda", 80, 32))
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            self._binders[id(fn)] = binder
        binder(*args, **kwargs)


class CountOps(TorchDispatchMode):
    """The aten ops dispatched inside the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class Step:
    """One batch's inputs as vLLM's model runner V2 gives them."""

    common: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    req_ids: list[str]
    # each KV-cache group's block table and slot mapping (the first group's are common's)
    tables: list[torch.Tensor] = dataclasses.field(default_factory=list)
    slot_mappings: list[torch.Tensor] = dataclasses.field(default_factory=list)


def make_step(batch: str, block_size: int, device: torch.device, groups: int = 1) -> Step:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    decodes = NUM_REQS if batch == "decode" else NUM_REQS - 1
    # decodes over contexts around 7936 (all different), then the prompt chunk
    q_lens = [1] * decodes
    seq_lens = [CONTEXT - 37 * i for i in range(decodes)]
    if batch != "decode":
        q_lens.append(CHUNK)
        seq_lens.append(CHUNK + (CACHED if batch == "gather" else 0))
    qsl_cpu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl_cpu[-1])
    blocks = -(-MAX_MODEL_LEN // block_size)
    table = torch.arange(len(q_lens) * blocks, dtype=torch.int32).view(len(q_lens), blocks)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device),
        num_reqs=len(q_lens),
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=(table % 64).to(device),  # never read: the launches are stubbed
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens_cpu,  # V2: no _num_computed_tokens_cpu
    )  # fmt: skip
    qkv = torch.zeros(n, NQ + 2 * NKV, D, dtype=torch.bfloat16, device=device)
    query, key, value = qkv.split([NQ, NKV, NKV], dim=1)  # strided views, as vLLM's qkv split
    output = torch.empty(n, NQ, D, dtype=torch.bfloat16, device=device)
    # every group's table and slot mapping its own buffer, as each KV-cache group's BlockTable's
    tables = [common.block_table_tensor]
    slot_mappings = [common.slot_mapping]
    for _ in range(1, groups):
        tables.append(common.block_table_tensor.clone())
        slot_mappings.append(common.slot_mapping.clone())
    req_ids = [f"r{i}" for i in range(len(q_lens))]
    return Step(common, query, key, value, output, req_ids, tables, slot_mappings)


def make_layers(kv_dtype: str, device: torch.device) -> tuple[Any, list[Any], list[torch.Tensor]]:
    """(builder, impls, kv caches) of LAYERS layers of SmolLM2's attention."""
    from vllm.config import set_current_vllm_config

    from int8kv_shim import sink_pages, tail_slots
    from int8kv_shim.attention_impl import Int8KVAttentionImpl, Int8KVAttentionMetadataBuilder
    from int8kv_shim.backend import Int8KVAttentionBackend

    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        model_config=SimpleNamespace(
            dtype=torch.bfloat16,
            get_num_kv_heads=lambda parallel: NKV,
            get_num_attention_heads=lambda parallel: NQ,
            get_head_size=lambda: D,
            max_model_len=MAX_MODEL_LEN,
        ),
        device_config=SimpleNamespace(device=str(device)),
        parallel_config=None,
        speculative_config=None,
    )
    bs = BLOCK_SIZES[kv_dtype]

    def noop_flash_attention(*args: object) -> None:
        return None

    tail_slots.uninstall()  # the process's int4 slot manager: one device at a time
    sink_pages.uninstall()
    impls = []
    with set_current_vllm_config(config):
        for _ in range(LAYERS):
            impl = Int8KVAttentionImpl(NQ, D, D**-0.5, NKV, None, None, kv_dtype, None, "decoder",
                                       None)  # fmt: skip
            impl._flash_attention = noop_flash_attention
            impls.append(impl)
    spec = SimpleNamespace(block_size=bs, int8kv_dtype=kv_dtype)
    builder = Int8KVAttentionMetadataBuilder(spec, ["layer"], config, device)
    builder.flash_prefill = True
    builder.num_sms = 132  # an H100/H200's, for the decode split choice
    shape = Int8KVAttentionBackend.get_kv_cache_shape(64, bs, NKV, D, kv_dtype)
    caches = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(LAYERS)]
    return builder, impls, caches


def run_step(builder: Any, impls: list[Any], caches: list[torch.Tensor], step: Step,
             clock: Callable[[], int] | None = None) -> dict[str, list[int]]:  # fmt: skip
    """One step as vLLM runs it: the builder, then per layer the cache update and the attention;
    with ``clock``, the time of each call."""
    clear_replays()  # a new step's launches: layer 1 records, the rest replay
    t = clock or (lambda: 0)
    times: dict[str, list[int]] = {"build": [], "update": [], "forward": []}
    t0 = t()
    md = builder.build(0, step.common)
    # the other groups' metadata: vLLM's model runner calls update_block_table per group
    mds = [
        md,
        *[
            builder.update_block_table(md, table, slots)
            for table, slots in zip(step.tables[1:], step.slot_mappings[1:], strict=True)
        ],
    ]
    times["build"].append(t() - t0)
    layer = SimpleNamespace(layer_name="layer")
    for i, (impl, cache) in enumerate(zip(impls, caches, strict=True)):
        md = mds[i % len(mds)]  # groups interleaved along the layers, as Gemma 3's
        t0 = t()
        impl.do_kv_cache_update(layer, step.key, step.value, cache, md.slot_mapping)
        t1 = t()
        impl.forward(layer, step.query, step.key, step.value, cache, md, step.output)
        t2 = t()
        times["update"].append(t1 - t0)
        times["forward"].append(t2 - t1)
    return times


def assign_rows(builder: Any, step: Step) -> None:
    """``int4``'s per-step rows, as the model runner's hooks fill them: a tail slot per request and,
    with sink pages, the sink each reads and writes. Every prompt is its own content; a request
    whose first page is computed this step (the first chunk of ``mixed``) writes its sink; the
    others (decodes, the ``gather`` chunk) are past their first page and write none (nor read
    one here, no earlier step having written it: a row's sink changes no launch)."""
    from int8kv_shim import sink_pages

    if builder.slots is None:
        return
    builder.slots.assign(step.req_ids)
    sinks = sink_pages.manager()
    if sinks is None:
        return
    qsl = step.common.query_start_loc_cpu.tolist()
    for r, req_id in enumerate(step.req_ids):
        new = qsl[r + 1] - qsl[r]
        computed = int(step.common.seq_lens_cpu_upper_bound[r]) - new
        prompt = [1000 + r] * sink_pages.PAGE_TOKENS
        sinks.add(req_id, sink_pages.sink_key(prompt), computed)
        sinks.computed(req_id, computed, new)
    sinks.assign(step.req_ids)


def measure(
    kv_dtype: str, batch: str, steps: int, launches: Launches, groups: int = 1
) -> dict[str, Any]:
    device = torch.device("cpu")
    builder, impls, caches = make_layers(kv_dtype, device)
    step = make_step(batch, BLOCK_SIZES[kv_dtype], device, groups)
    assign_rows(builder, step)
    for _ in range(5):
        run_step(builder, impls, caches, step)
    launches.counts.clear()
    run_step(builder, impls, caches, step)
    per_step = dict(launches.counts)
    samples: dict[str, list[float]] = {}
    clock = time.perf_counter_ns
    for _ in range(steps):
        times = run_step(builder, impls, caches, step, clock)
        samples.setdefault("build", []).append(times["build"][0] / 1e3)
        for name in ("update", "forward"):
            samples.setdefault(name + "_first", []).append(times[name][0] / 1e3)
            samples.setdefault(name + "_rest", []).extend(t / 1e3 for t in times[name][1:])
            samples.setdefault(name + "_step", []).append(sum(times[name]) / 1e3)
    res: dict[str, Any] = {k + "_us": statistics.median(v) for k, v in samples.items()}
    res["step_us"] = res["build_us"] + res["update_step_us"] + res["forward_step_us"]
    res |= {k + "_per_step": v for k, v in per_step.items()}
    # aten ops of each call, views included (under the mode, so not timed)
    clear_replays()
    layer = SimpleNamespace(layer_name="layer")
    ops: dict[str, Counter[str]] = {}
    with CountOps() as c:
        md = builder.build(0, step.common)
    ops["build"] = c.ops
    for i, (impl, cache) in enumerate(zip(impls[:2], caches[:2], strict=True)):
        which = "first" if i == 0 else "rest"
        with CountOps() as c:
            impl.do_kv_cache_update(layer, step.key, step.value, cache, md.slot_mapping)
        ops["update_" + which] = c.ops
        with CountOps() as c:
            impl.forward(layer, step.query, step.key, step.value, cache, md, step.output)
        ops["forward_" + which] = c.ops
    for name, counter in ops.items():
        res[name + "_ops"] = sum(counter.values())
        res[name + "_op_names"] = dict(counter.most_common())
    return res


def check_syncs(kv_dtype: str, batch: str) -> str | None:
    """None when a step of ``batch`` runs with its device tensors on ``meta`` (no host read of a
    device value), else the error."""
    device = torch.device("meta")
    builder, impls, caches = make_layers(kv_dtype, device)
    step = make_step(batch, BLOCK_SIZES[kv_dtype], device)
    assign_rows(builder, step)  # the per-step rows come from the host (a copy to the device)
    try:
        run_step(builder, impls[:2], caches[:2], step)
    except Exception as e:  # noqa: BLE001  the report says which
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "host_overhead.json"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtypes", default="int8,int4")
    ap.add_argument("--batches", default=",".join(BATCHES))
    ap.add_argument("--no-binder", action="store_true", help="leave Triton's binder out")
    ap.add_argument("--check-syncs", action="store_true", help="also run on the meta device")
    ap.add_argument(
        "--groups",
        type=int,
        default=1,
        help="KV-cache groups, each its own block table and slot mapping",
    )
    args = ap.parse_args()
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" or torch.cuda.is_available():
        sys.exit("run with CUDA_VISIBLE_DEVICES= (a CPU measurement)")
    torch.set_num_threads(1)
    launches = Launches(binder=not args.no_binder)
    launches.install()
    res: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.host_overhead", *sys.argv[1:]]),
        "gpu": None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "binder": not args.no_binder,
        # the shim's switches it ran with (int4's sink page and tail pages decide its launches)
        "int8kv_env": shim_switches(),
        "rows": [],
    }
    for kv_dtype in args.dtypes.split(","):
        for batch in args.batches.split(","):
            row = {"dtype": kv_dtype, "batch": batch, "groups": args.groups,
                   **measure(kv_dtype, batch, args.steps, launches, args.groups)}  # fmt: skip
            if args.check_syncs:
                row["sync"] = check_syncs(kv_dtype, batch)
            res["rows"].append(row)
            print(
                f"{kv_dtype:5s} {batch:7s} build {row['build_us']:6.1f} us ({row['build_ops']} ops)"
                f" | update first {row['update_first_us']:5.1f} rest {row['update_rest_us']:5.1f}"
                f" ({row['update_rest_ops']} ops) | forward first {row['forward_first_us']:6.1f}"
                f" rest {row['forward_rest_us']:6.1f} ({row['forward_first_ops']}/"
                f"{row['forward_rest_ops']} ops) | step {row['step_us']:7.1f} us | launches "
                f"{row.get('launches_per_step', 0)} replays {row.get('replays_per_step', 0)}"
                + (f" | sync: {row['sync']}" if args.check_syncs else ""),
                flush=True,
            )
    write_json(res, args.out)  # with the date and the commit measured


if __name__ == "__main__":
    main()

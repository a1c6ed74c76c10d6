"""Runs inside the test subprocesses (not a test module): imports the real vLLM and reports, as
JSON, everything the shim may change, so the tests can compare processes (pristine, off, active,
late-activated, ...) with each other.

Importing this module imports nothing from vLLM or the shim: the subprocess script decides the
import order, which is part of what is tested.
"""

from __future__ import annotations

import ctypes
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

RESULT_MARK = "PROBE-RESULT "

SHIM_TESTS = Path(__file__).resolve().parent
SITECUSTOMIZE_DIR = SHIM_TESTS.parents[1] / "sitecustomize_example"

CAPABILITIES = [(8, 6), (8, 0), (9, 0), (10, 0), (7, 5)]
UPSTREAM_DTYPES = ["auto", "bfloat16", "fp8", "int8_per_token_head", "turboquant_k8v4"]


def stub_cuda_ops_without_driver() -> None:
    """Test-only: ``vllm.platforms.cuda`` imports a compiled op library that needs ``libcuda``.

    Without a GPU driver there is nothing to load, so an empty module stands in for it
    (``docs/vllm-touchpoints.md``, test-only names). Nothing the shim patches calls into it.
    """
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        sys.modules.setdefault(
            "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch")
        )


def prelude(names: list[str]) -> str:
    """First lines of every scenario: import `probe` (``run_python`` puts tests/shim on the
    child's PYTHONPATH), stand in for the CUDA op library."""
    return f"import sys\nimport probe\nprobe.stub_cuda_ops_without_driver()\nNAMES = {names!r}\n"


def emit(result: dict[str, Any]) -> None:
    print(RESULT_MARK + json.dumps(result, sort_keys=True), flush=True)


def _dtype_args(literal: Any) -> list[str]:
    return list(typing.get_args(literal))


def snapshot(names: list[str]) -> dict[str, Any]:
    """Every vLLM object a shim patch touches, in comparable (JSON) form."""
    import vllm.config.cache as cache
    import vllm.model_executor.layers.attention.attention as attention
    import vllm.platforms.cuda as cuda
    import vllm.v1.attention.selector as selector
    import vllm.v1.engine.core as engine_core
    from pydantic import ValidationError
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import get_kwargs
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends import registry

    def cache_config_accepts(dtype: str) -> bool:
        try:
            CacheConfig(cache_dtype=dtype)
        except ValidationError:
            return False
        return True

    def vllm_config_accepts(dtype: str) -> bool:
        # A dict, so VllmConfig's own (embedded) copy of the CacheConfig schema validates it.
        try:
            VllmConfig(
                cache_config={"cache_dtype": dtype}, device_config=DeviceConfig(device="cpu")
            )
        except ValidationError:
            return False
        return True

    priorities = {}
    for use_mla in (False, True):
        for cap in CAPABILITIES:
            for dtype in [*UPSTREAM_DTYPES, *names]:
                key = f"mla={use_mla} cap={cap[0]}.{cap[1]} kv={dtype}"
                result = cuda._get_backend_priorities(use_mla, DeviceCapability(*cap), 32, dtype)
                priorities[key] = [b.name for b in result]

    probe_dtypes = [*names, "auto", "bfloat16", "int8_per_token_head", "bogus"]
    return {
        "cache_dtype_literal": _dtype_args(cache.CacheDType),
        "cache_config_field": _dtype_args(CacheConfig.__dataclass_fields__["cache_dtype"].type),
        "selector_literal": _dtype_args(selector.CacheDType),
        "cli_choices": get_kwargs(CacheConfig)["cache_dtype"]["choices"],
        "cache_config_accepts": {d: cache_config_accepts(d) for d in probe_dtypes},
        "vllm_config_accepts": {d: vllm_config_accepts(d) for d in [*names, "auto", "bogus"]},
        "str_dtype_to_torch_dtype": {k: str(v) for k, v in STR_DTYPE_TO_TORCH_DTYPE.items()},
        "attn_overrides": {k.name: v for k, v in registry._ATTN_OVERRIDES.items()},
        "priorities": priorities,
        "priorities_function": type(cuda._get_backend_priorities).__name__,
        "kv_cache_spec_method": type(attention.Attention.get_kv_cache_spec).__name__,
        "process_weights_method": type(attention.Attention.process_weights_after_loading).__name__,
        "engine_core_kv_cache_configs": type(engine_core.get_kv_cache_configs).__name__,
    }


def _selector_config(**overrides: Any) -> Any:
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields: dict[str, Any] = {
        "head_size": 128,
        "dtype": torch.bfloat16,
        "kv_cache_dtype": "int8",
        "block_size": None,
        "attn_type": "decoder",
    }
    fields.update(overrides)
    return AttentionSelectorConfig(**fields)


def select_backend(cap: tuple[int, int], **overrides: Any) -> dict[str, Any]:
    """vLLM's own candidate validation for one layer, as ``get_attn_backend_cls`` runs it.

    ``get_attn_backend_cls`` itself asks the driver for the capability; ``get_valid_backends`` takes
    it as an argument, and the rest (lowest priority index wins) is one line.
    """
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    valid, invalid = CudaPlatformBase.get_valid_backends(
        DeviceCapability(*cap), _selector_config(**overrides), num_heads=32
    )
    chosen = min(valid, key=lambda c: c.priority) if valid else None
    return {
        "valid": sorted(c.backend.name for c in valid),
        "chosen": chosen.backend.name if chosen else None,
        "class": (
            f"{chosen.backend_class.__module__}.{chosen.backend_class.__qualname__}"
            if chosen
            else None
        ),
        "reasons": {backend.name: reasons for backend, (_, reasons) in invalid.items()},
    }


def selection(names: list[str]) -> dict[str, Any]:
    """The backend vLLM picks for our dtypes and for two of its own, on three capabilities."""
    result: dict[str, Any] = {}
    for cap in [(8, 6), (8, 0), (9, 0)]:
        for dtype in [*names, "auto", "bfloat16"]:
            result[f"cap={cap[0]}.{cap[1]} kv={dtype}"] = select_backend(cap, kv_cache_dtype=dtype)
    return result


def refusals() -> dict[str, Any]:
    """Layers our backend must refuse, with the reasons vLLM would put in its startup error."""
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result: dict[str, Any] = {}
    cases = {
        "cap=7.5": {"cap": (7, 5)},
        "head_size=80": {"cap": (8, 6), "head_size": 80},
        "encoder_only": {"cap": (8, 6), "attn_type": "encoder_only"},
        "float32": {"cap": (8, 6), "dtype": torch.float32},
    }
    for label, spec in cases.items():
        spec = dict(spec)
        result[label] = select_backend(spec.pop("cap"), **spec)
    # The MLA candidates' modules allocate CUDA buffers at import, so without a GPU vLLM's full
    # candidate walk cannot run for MLA; our backend's own validation is what matters here.
    backend = AttentionBackendEnum.CUSTOM.get_class()
    config = _selector_config(use_mla=True, head_size=576)
    reasons = backend.validate_configuration(
        device_capability=DeviceCapability(8, 6), **config._asdict()
    )
    result["mla"] = {"chosen": None if reasons else "CUSTOM", "reasons": {"CUSTOM": reasons}}
    # A --block-size the user chose (vLLM's candidate walk would need a config for the others'
    # block-size checks): our validation of it.
    for block in (16, 64):
        config = _selector_config(kv_cache_dtype="int4", block_size=block)
        reasons = backend.validate_configuration(
            device_capability=DeviceCapability(8, 6), **config._asdict()
        )
        result[f"int4 block_size={block}"] = {
            "chosen": None if reasons else "CUSTOM", "reasons": {"CUSTOM": reasons},
        }  # fmt: skip
    return result


def backend_facts(names: list[str]) -> dict[str, Any]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CUSTOM.get_class()
    impl_errors: dict[str, str | None] = {}
    impls = {}
    # vLLM builds layers with its config current (int4 sizes its tail pool from it)
    with _current_config(max_num_seqs=3):
        for name in names:
            try:
                impls[name] = backend.get_impl_cls()(
                    32, 128, 0.1, 8, None, None, name, None, "decoder", None
                )
                impl_errors[name] = None
            except ValueError as exc:
                impl_errors[name] = str(exc)
        shared = backend.get_impl_cls()(32, 128, 0.1, 8, None, None, "int4", None, "decoder", "x")
    try:
        backend.get_impl_cls()(32, 128, 0.1, 8, None, None, "int4", None, "decoder", None)
        int4_without_config = None
    except ValueError as exc:
        int4_without_config = str(exc)
    from int8kv_shim import tail_slots

    slots = tail_slots.manager()
    return {
        "tail_pools": {
            name: None
            if impl.tail is None
            else [
                str(impl.tail.dtype),
                list(impl.tail.shape),
                impl.tail_page.tolist(),
                None if impl.sink is None else list(impl.sink.shape),
            ]
            for name, impl in impls.items()
        },  # fmt: skip
        "shared_layer_pool": shared.tail is None,
        "int4_without_config": int4_without_config,
        "pool_accounting": None
        if slots is None
        else [
            slots.num_slots,
            slots.pool_layers,
            slots.pool_bytes,
            slots.pool_cache_tokens(),
        ],  # fmt: skip
        "preferred_block_size": _preferred_block_sizes(backend, names),
        "class": f"{backend.__module__}.{backend.__qualname__}",
        "name": backend.get_name(),
        "enum_roundtrip": AttentionBackendEnum[backend.get_name()].name,
        "is_mla": backend.is_mla(),
        "forward_includes_kv_cache_update": backend.forward_includes_kv_cache_update,
        "supported_dtypes": [str(d) for d in backend.supported_dtypes],
        "supported_kv_cache_dtypes": list(backend.supported_kv_cache_dtypes),
        "kv_cache_shape": {d: list(backend.get_kv_cache_shape(10, 16, 8, 128, d)) for d in names},
        "impl_errors": impl_errors,
        "spec_vs_shape_bytes": _spec_vs_shape_bytes(backend, names),
        "layer_specs": _layer_specs(names),
    }


def _current_config(max_num_seqs: int, cache_dtype: str = "auto") -> Any:
    """vLLM's set_current_vllm_config with a stand-in holding what our backend reads (a real
    VllmConfig needs a model and a device)."""
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config

    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        device_config=SimpleNamespace(device="cpu"),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )
    return set_current_vllm_config(config)


def _preferred_block_sizes(backend: Any, names: list[str]) -> dict[str, int]:
    """The block size vLLM takes from our backend when the user gave none (its default is 16)."""
    out = {}
    for name in [*names, "auto"]:
        with _current_config(1, cache_dtype=name):
            out[name] = backend.get_preferred_block_size(16)
    return out


def _layer_specs(names: list[str]) -> dict[str, str]:
    """Spec class that (patched) ``Attention.get_kv_cache_spec`` returns per dtype and window.

    The method only reads plain attributes, so a namespace stands in for a built layer (building
    a real one needs a model config and a device).
    """
    from types import SimpleNamespace

    import torch
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.v1.attention.backend import AttentionType

    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16), model_config=SimpleNamespace(use_mla=False)
    )
    specs = {}
    for dtype in [*names, "auto"]:
        for window in (None, 64):
            layer = SimpleNamespace(
                attn_type=AttentionType.DECODER, kv_cache_dtype=dtype, sliding_window=window,
                num_kv_heads=4, head_size=128, head_size_v=128, kv_cache_torch_dtype=torch.int8,
            )  # fmt: skip
            spec = attention.Attention.get_kv_cache_spec(layer, config)
            specs[f"{dtype} window={window}"] = type(spec).__name__
    return specs


def _spec_vs_shape_bytes(backend: Any, names: list[str]) -> list[tuple]:
    """(dtype, head, block, kind, spec page bytes, shape bytes) for every combination.

    vLLM reshapes each layer's raw buffer with ``backend.get_kv_cache_shape`` after sizing it from
    the spec's ``page_size_bytes`` (engine core), so the two must agree byte for byte.
    """
    import math

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from int8kv_shim.kv_spec import to_int8kv_spec

    rows = []
    for name in names:
        for head in (64, 128, 256):
            for block in (16, 32, 64):
                common = dict(block_size=block, num_kv_heads=4, head_size=head, dtype=torch.int8)
                for kind, spec in (
                    ("full", FullAttentionSpec(**common)),
                    ("sliding", SlidingWindowSpec(**common, sliding_window=128)),
                ):
                    ours = to_int8kv_spec(spec, name)
                    merged = type(ours).merge([ours, ours])
                    shape = backend.get_kv_cache_shape(7, block, 4, head, name)
                    rows.append(
                        (name, head, block, kind, ours.page_size_bytes,
                         math.prod(shape[1:]) * torch.int8.itemsize,
                         merged.page_size_bytes, type(merged).__name__)
                    )  # fmt: skip
    return rows


def cli(names: list[str], create_engine_config: bool = False) -> dict[str, Any]:
    """The ``vllm serve`` argument parser, as far as it can be built here, and what it accepts.

    Without a GPU, ``make_arg_parser`` stops at ``DeviceConfig`` ("Failed to infer device type"),
    after ``--kv-cache-dtype`` has been added (the serve path: ``AsyncEngineArgs.add_cli_args``,
    which loads vLLM's general plugins first, then ``EngineArgs.add_cli_args``).
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    try:
        make_arg_parser(parser)
        complete = True
    except RuntimeError as exc:
        if "infer device type" not in str(exc):
            raise
        complete = False
    action = parser._option_string_actions["--kv-cache-dtype"]

    parsed: dict[str, Any] = {}
    for dtype in [*names, "auto", "bogus"]:
        try:
            parsed[dtype] = parser.parse_args(["--kv-cache-dtype", dtype]).kv_cache_dtype
        except SystemExit:
            parsed[dtype] = None

    engine: dict[str, Any] = {}
    for dtype in [*names, "auto"]:
        if parsed.get(dtype) is None:
            continue
        # A local path that does not exist: nothing may reach for the network.
        args = EngineArgs(model="/nonexistent/int8kv-test-model", kv_cache_dtype=parsed[dtype])
        entry: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}
        if create_engine_config:
            try:
                args.create_engine_config()
                entry["create_engine_config"] = "ok"
            except Exception as exc:
                entry["create_engine_config"] = f"{type(exc).__name__}: {exc}"
        else:
            # The step create_engine_config takes with the string (it needs a GPU as a whole).
            from vllm.config import CacheConfig
            from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

            resolved = resolve_kv_cache_dtype_string(args.kv_cache_dtype, None)
            entry["cache_config"] = CacheConfig(cache_dtype=resolved).cache_dtype
        engine[dtype] = entry
    return {
        "parser_complete": complete,
        "choices": list(action.choices),
        "parsed": parsed,
        "engine_args": engine,
    }


def static_scales_loading() -> dict[str, Any]:
    """Patch P8 on stand-in layers: ``Attention.process_weights_after_loading`` (called through
    the class, as vLLM's loader calls it on each layer) loads ``int8_static`` scales.

    A real layer needs a model config and a device; here a bare module with vLLM's default scale
    buffers, our impl, a stand-in current vLLM config and a stubbed TP rank stand in for them.
    """
    import os
    import tempfile
    from types import SimpleNamespace

    import torch
    import vllm.config.vllm as vllm_config_module
    import vllm.model_executor.layers.attention.attention as attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from int8kv_shim.static import file as scales_file
    from int8kv_shim.static import load as static_scales

    impl_cls = AttentionBackendEnum.CUSTOM.get_class().get_impl_cls()
    tmp = Path(tempfile.mkdtemp(prefix="int8kv-scales-"))
    model_dir = tmp / "model"
    model_dir.mkdir()

    def write(path: Path, kv_heads: int, base: float, v_format: str = "int8") -> Path:
        # K: channel c of head h of layer i at base + 10 i + h + c / 128; V: 127 + h per channel
        stats = {
            i: (f"model.layers.{i}.self_attn.attn",
                [[base + 10 * i + h + c / 128 for c in range(128)] for h in range(kv_heads)],
                [[127.0 + h] * 128 for h in range(kv_heads)])
            for i in range(2)
        }  # fmt: skip
        return scales_file.write(path, scales_file.build(
            model=str(model_dir), num_layers=2, num_kv_heads=kv_heads, head_dim=128,
            v_format=v_format, statistic="absmax", num_tokens=64, stats=stats,
        ))  # fmt: skip

    write(model_dir / scales_file.DEFAULT_FILENAME, 8, 127.0)
    override = write(tmp / "override.json", 8, 254.0)
    two_heads = write(tmp / "two_heads.json", 2, 127.0)
    e4m3 = write(tmp / "e4m3.json", 8, 127.0, "e4m3")

    loads: list[str] = []
    real_load = scales_file.load

    def counting_load(path: Any, how: str = "") -> Any:
        loads.append(Path(path).name)
        return real_load(path, how)

    def run(
        dtype: str = "int8_static",
        *,
        env: str | None = None,
        tp: tuple[int, int] = (0, 1),
        kv_heads: int = 8,
        local_kv: int = 8,
        head_dim: int = 128,
        index: int = 1,
    ) -> Any:
        vllm_config_module._current_vllm_config = SimpleNamespace(model_config=SimpleNamespace(
            model=str(model_dir), get_total_num_hidden_layers=lambda: 2,
            get_total_num_kv_heads=lambda: kv_heads, get_head_size=lambda: head_dim,
        ))  # fmt: skip
        static_scales._tp_rank_and_size = lambda: tp
        if env is None:
            os.environ.pop("INT8KV_SCALES", None)
        else:
            os.environ["INT8KV_SCALES"] = env
        layer = torch.nn.Module()
        layer.kv_cache_dtype, layer.quant_config = dtype, None
        layer.layer_name = f"model.layers.{index}.self_attn.attn"
        layer.impl = impl_cls(32, 128, 0.1, local_kv, None, None, dtype, None, "decoder", None)
        attention.set_default_quant_scales(layer, register_buffer=True)
        try:
            attention.Attention.process_weights_after_loading(layer, torch.bfloat16)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        impl = layer.impl
        if impl.k_scale is None:
            return None
        return {  # per head: channel 0 (and the last channel's K), times 127
            "k": [round(row[0] * 127, 6) for row in impl.k_scale.tolist()],
            "k_last_channel": [round(row[-1] * 127, 6) for row in impl.k_scale.tolist()],
            "v": [round(row[0] * 127, 6) for row in impl.v_scale.tolist()],
            "shape": list(impl.k_scale.shape),
            "v_format": impl.v_format,
            "dtype": str(impl.k_scale.dtype),
            "device": str(impl.k_scale.device),
            "vllm_k_scale": float(layer._k_scale),  # vLLM's own buffer: reset to 1.0, unused
        }

    saved = (vllm_config_module._current_vllm_config, static_scales._tp_rank_and_size)
    scales_file.load = counting_load
    try:
        result: dict[str, Any] = {
            "model_dir": run(),
            "model_dir_layer0": run(index=0),
            "env_override": run(env=str(override)),
            "tp2_rank1": run(tp=(1, 2), local_kv=4),
            "tp4_rank2_two_heads": run(env=str(two_heads), tp=(2, 4), kv_heads=2, local_kv=1),
            "int8_layer": run("int8"),
            "missing": run(env=str(tmp / "missing.json")),
            "wrong_head_dim": run(head_dim=64),
            "e4m3": run(env=str(e4m3)),
            "files": {p.name: str(p) for p in (override, two_heads, e4m3, tmp / "missing.json")},
            "model_file": str(model_dir / scales_file.DEFAULT_FILENAME),
        }
        bare = impl_cls(32, 128, 0.1, 8, None, None, "int8_static", None, "decoder", None)
        try:
            bare._kernel_scales()
            result["unloaded_forward"] = None
        except RuntimeError as exc:
            result["unloaded_forward"] = str(exc)
        result["loads"] = loads
    finally:
        scales_file.load = real_load
        vllm_config_module._current_vllm_config, static_scales._tp_rank_and_size = saved
        os.environ.pop("INT8KV_SCALES", None)
        static_scales.clear_cache()
    return result


def parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    raise AssertionError("the subprocess printed no result")

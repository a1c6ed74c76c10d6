"""Every change the shim makes to vLLM 0.24.0, one small named function per site.

Each ``patch_*`` / ``guard_*`` function takes the freshly imported vLLM module it patches (they run
as wrapt post-import hooks, or at once when the module is already imported), is idempotent, and
records how to undo itself; :func:`undo_all` puts vLLM back exactly as it was. Each site, why it is
patched and what breaks if vLLM changes it: ``docs/vllm-touchpoints.md`` (by the labels P1..P14
below; it also lists the vLLM and Triton internals read outside this module).

Two sets of sites:

* ``ACTIVE_SITES`` -- the supported vLLM: make our dtypes valid and route them to our backend.
* ``GUARD_SITES`` -- any other vLLM (the shim is inert): widen nothing, but turn a request for one
  of our dtypes into :class:`~int8kv_shim.package.UnsupportedVLLMVersionError` instead of
  pydantic's generic "Input should be 'auto', ..." error. They touch only
  ``EngineArgs.create_engine_config`` and ``get_kwargs`` in ``vllm.engine.arg_utils``, stable for
  many releases, and skip themselves where they do not find them.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wrapt

from int8kv_shim._logging import get_logger
from int8kv_shim.catalogue_loader import dtype_names, load_catalogue
from int8kv_shim.package import UnsupportedVLLMVersionError, VersionCheck, check_vllm_version

BACKEND_CLASS_PATH = "int8kv_shim.backend.Int8KVAttentionBackend"

# Patch name -> undo callable, in application order. Presence means "applied": the idempotence test.
_UNDO: dict[str, Callable[[], None]] = {}

_MISSING = object()

# vLLM's own CacheDType, kept by P1 for modules that bind the name after P1 ran (P2).
_upstream_cache_dtype: dict[str, Any] = {}

# What made the shim inert (set by instrument()); the guards' error quotes it.
_inert_because: list[VersionCheck] = []


def set_inert_reason(check: VersionCheck) -> None:
    _inert_because[:] = [check]


def is_applied(name: str) -> bool:
    return name in _UNDO


def applied_patches() -> tuple[str, ...]:
    return tuple(_UNDO)


def undo_all() -> None:
    """Revert every applied patch, newest first (later patches may rely on earlier ones)."""
    for name in reversed(list(_UNDO)):
        _UNDO.pop(name)()


# --------------------------------------------------------------------------------------------------
# P1  vllm.config.cache: CacheDType and CacheConfig's validator


def patch_cache_dtype_literal(cache: ModuleType) -> None:
    """Add our names to ``CacheDType`` and rebuild CacheConfig's pydantic schema with them.

    pydantic builds the validator when the class is created, from ``__dataclass_fields__[...].type``;
    rebinding the module's ``CacheDType`` alone would change nothing.
    """
    if is_applied("cache_dtype_literal"):
        return
    config_cls = cache.CacheConfig
    field = config_cls.__dataclass_fields__["cache_dtype"]
    original = (cache.CacheDType, field.type, config_cls.__annotations__.get("cache_dtype"))
    names = typing.get_args(cache.CacheDType) + dtype_names()
    widened = typing.Literal[tuple(dict.fromkeys(names))]  # type: ignore[valid-type]

    _upstream_cache_dtype["literal"] = cache.CacheDType
    _set_cache_dtype_type(cache, widened, widened, widened)
    _UNDO["cache_dtype_literal"] = lambda: _set_cache_dtype_type(cache, *original)
    get_logger().info("int8kv-shim active: --kv-cache-dtype accepts %s", ", ".join(dtype_names()))


def _set_cache_dtype_type(
    cache: ModuleType, literal: Any, field_type: Any, annotation: Any
) -> None:
    from pydantic.dataclasses import rebuild_dataclass

    config_cls = cache.CacheConfig
    cache.CacheDType = literal
    config_cls.__dataclass_fields__["cache_dtype"].type = field_type
    if annotation is None:
        config_cls.__annotations__.pop("cache_dtype", None)
    else:
        config_cls.__annotations__["cache_dtype"] = annotation
    rebuild_dataclass(config_cls, force=True)
    # VllmConfig embeds CacheConfig's schema when it is built; when the shim comes late (plugin
    # path) it already exists and would still reject `cache_config={"cache_dtype": "int8"}`.
    vllm_config_mod = sys.modules.get("vllm.config.vllm")
    if vllm_config_mod is not None and hasattr(vllm_config_mod, "VllmConfig"):
        rebuild_dataclass(vllm_config_mod.VllmConfig, force=True)
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None:
        _clear_cli_kwargs_cache(arg_utils)


# --------------------------------------------------------------------------------------------------
# P2  vllm.v1.attention.selector: its own binding of CacheDType


def patch_selector_cache_dtype(selector: ModuleType) -> None:
    """``get_attn_backend`` asserts the dtype is in the ``CacheDType`` it imported by name."""
    if is_applied("selector_cache_dtype"):
        return
    cache = sys.modules.get("vllm.config.cache")
    if cache is None or not is_applied("cache_dtype_literal"):
        return  # nothing widened to propagate (the selector imports vllm.config.cache first)
    original = selector.CacheDType
    if original is cache.CacheDType:
        # Imported after P1, so it bound the widened Literal; undo must still restore vLLM's own.
        original = _upstream_cache_dtype["literal"]
    selector.CacheDType = cache.CacheDType

    def undo() -> None:
        selector.CacheDType = original

    _UNDO["selector_cache_dtype"] = undo


# --------------------------------------------------------------------------------------------------
# P3  vllm.engine.arg_utils: the lru-cached CLI kwargs


def patch_cli_choices_cache(arg_utils: ModuleType) -> None:
    """Drop ``--kv-cache-dtype`` choices computed from the old Literal (late activation)."""
    if is_applied("cli_choices_cache"):
        return
    _clear_cli_kwargs_cache(arg_utils)
    _UNDO["cli_choices_cache"] = lambda: _clear_cli_kwargs_cache(arg_utils)


def _clear_cli_kwargs_cache(arg_utils: ModuleType) -> None:
    compute_kwargs = getattr(arg_utils, "_compute_kwargs", None)
    if compute_kwargs is not None:
        compute_kwargs.cache_clear()


# --------------------------------------------------------------------------------------------------
# P4  vllm.utils.torch_utils: STR_DTYPE_TO_TORCH_DTYPE


def patch_str_dtype_to_torch_dtype(torch_utils: ModuleType) -> None:
    """Map our names to ``torch.int8``: each block is one flat int8 page (scales included).

    Mutated in place because several modules imported the dict by name. ``"int8"`` is already
    there upstream; undo restores exactly what was there before, absent keys included.
    """
    if is_applied("str_dtype_to_torch_dtype"):
        return
    import torch

    table = torch_utils.STR_DTYPE_TO_TORCH_DTYPE
    saved = {name: table.get(name, _MISSING) for name in dtype_names()}
    for name in saved:
        table[name] = torch.int8

    def undo() -> None:
        for name, value in saved.items():
            if value is _MISSING:
                table.pop(name, None)
            else:
                table[name] = value

    _UNDO["str_dtype_to_torch_dtype"] = undo


# --------------------------------------------------------------------------------------------------
# P5  vllm.v1.attention.backends.registry: AttentionBackendEnum.CUSTOM


def patch_register_backend(registry: ModuleType) -> None:
    """Point ``CUSTOM`` at our backend; the registry is a per-process dict, so every process."""
    if is_applied("register_backend"):
        return
    custom = registry.AttentionBackendEnum.CUSTOM
    previous = registry._ATTN_OVERRIDES.get(custom)
    if previous is not None and previous != BACKEND_CLASS_PATH:
        # Only our backend can read our page layout, so ours must win for our dtypes.
        get_logger().warning(
            "int8kv-shim: replacing the CUSTOM attention backend %s registered by someone "
            "else with %s",
            previous,
            BACKEND_CLASS_PATH,
        )
    registry.register_backend(custom, BACKEND_CLASS_PATH)

    def undo() -> None:
        if previous is None:
            registry._ATTN_OVERRIDES.pop(custom, None)
        else:
            registry.register_backend(custom, previous)

    _UNDO["register_backend"] = undo


# --------------------------------------------------------------------------------------------------
# P6  vllm.platforms.cuda: _get_backend_priorities


def patch_backend_priorities(cuda: ModuleType) -> None:
    """Put CUSTOM first for layers whose KV dtype is ours; every other call is untouched.

    ``get_valid_backends`` looks the function up as a module global at call time, so rebinding it
    is enough. No other backend accepts our dtype strings, so a refusal by ours (compute
    capability, head size, MLA, ...) surfaces as vLLM's "No valid attention backend" error with
    our reason in it, never as a silent fall-back.
    """
    if is_applied("backend_priorities"):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    ours = frozenset(dtype_names())
    original = cuda._get_backend_priorities

    def put_ours_first(
        wrapped: Callable[..., list[Any]], instance: Any, args: tuple, kwargs: dict
    ) -> list[Any]:
        priorities = wrapped(*args, **kwargs)
        if _kv_cache_dtype_arg(*args, **kwargs) not in ours:
            return priorities  # the very list vLLM returns (it is @cache'd): unchanged
        return [custom, *(b for b in priorities if b is not custom)]

    cuda._get_backend_priorities = wrapt.FunctionWrapper(original, put_ours_first)

    def undo() -> None:
        cuda._get_backend_priorities = original

    _UNDO["backend_priorities"] = undo


def _kv_cache_dtype_arg(
    use_mla: bool,
    device_capability: Any,
    num_heads: int | None = None,
    kv_cache_dtype: str | None = None,
) -> str | None:
    # Mirrors _get_backend_priorities' signature so positional and keyword calls both bind.
    return kv_cache_dtype


# --------------------------------------------------------------------------------------------------
# P7  vllm.model_executor.layers.attention.attention: Attention.get_kv_cache_spec


def patch_kv_cache_spec(attention: ModuleType) -> None:
    """Give layers with our dtypes a spec whose page size counts every byte of our page.

    vLLM's own spec would size a page as 2 * head_size bytes per token-head (scales not counted),
    and the engine core sizes the whole cache from specs, so our layers get our spec subclasses.
    """
    if is_applied("kv_cache_spec"):
        return
    ours = frozenset(dtype_names())
    original = attention.Attention.get_kv_cache_spec

    def use_our_spec(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        spec = wrapped(*args, **kwargs)
        layer = instance if instance is not None else args[0]  # called through the class
        if spec is None or layer.kv_cache_dtype not in ours:
            return spec
        from int8kv_shim.kv_spec import to_int8kv_spec

        return to_int8kv_spec(spec, layer.kv_cache_dtype)

    attention.Attention.get_kv_cache_spec = wrapt.FunctionWrapper(original, use_our_spec)

    def undo() -> None:
        attention.Attention.get_kv_cache_spec = original

    _UNDO["kv_cache_spec"] = undo


# --------------------------------------------------------------------------------------------------
# P8  vllm.model_executor.layers.attention.attention: Attention.process_weights_after_loading
#


def patch_static_scales_loader(attention: ModuleType) -> None:
    """Load ``int8_static`` layers' per-channel scales from the calibration file after loading.

    vLLM's own method runs first (it resets ``_k_scale``/``_v_scale`` to 1.0, which our kernels
    never read); then :func:`int8kv_shim.static.load.load_into_layer` sets the impl's scales for
    this TP rank, or stops start-up with one line naming the file and what is wrong with it.
    Layers with any other dtype are untouched.
    """
    if is_applied("static_scales_loader"):
        return
    original = attention.Attention.process_weights_after_loading
    static_dtype = load_catalogue().STATIC_DTYPE

    def load_static_scales(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        result = wrapped(*args, **kwargs)
        layer = instance if instance is not None else args[0]  # called through the class
        if getattr(layer, "kv_cache_dtype", None) == static_dtype:
            from int8kv_shim.static.load import load_into_layer

            load_into_layer(layer)
        return result

    attention.Attention.process_weights_after_loading = wrapt.FunctionWrapper(
        original, load_static_scales
    )

    def undo() -> None:
        attention.Attention.process_weights_after_loading = original

    _UNDO["static_scales_loader"] = undo


# --------------------------------------------------------------------------------------------------
# P9  vllm.engine.arg_utils: EngineArgs.create_model_config (models our cache cannot serve)

# Why each model kind is refused, by vLLM's ModelConfig.attn_type (MLA is checked first: an MLA
# model's attn_type is "decoder"). Each reason ends with what to do instead.
_OWN_DTYPES_HINT = "use one of vLLM's own --kv-cache-dtype values (auto, fp8, ...)"
_UNSUPPORTED_MODEL_KINDS: dict[str, str] = {
    "mla": (
        "MLA (latent-attention) models are not supported: their cache holds one compressed "
        "latent per token, not per-head K and V"
    ),
    "hybrid": (
        "hybrid (attention + Mamba/linear-attention) models are not supported: vLLM sizes their "
        "attention pages together with the recurrent-state pages using its own byte count, "
        "which does not include our per-token scales"
    ),
    "attention_free": "attention-free models have no KV cache to quantize",
    "encoder_only": (
        "encoder-only models are not supported: only decoder self-attention has a KV cache to "
        "quantize"
    ),
    "encoder_decoder": (
        "encoder-decoder models are not supported: the kernels serve decoder self-attention "
        "only, not cross-attention"
    ),
}


def unsupported_model_reason(model_config: Any, kv_cache_dtype: str) -> str | None:
    """The one-line refusal for a model our dtype cannot serve, or None when it can.

    Reads only ``use_mla``, ``attn_type`` and ``architecture`` of vLLM's ModelConfig, so a
    stand-in object works in tests.
    """
    kind = "mla" if getattr(model_config, "use_mla", False) else model_config.attn_type
    why = _UNSUPPORTED_MODEL_KINDS.get(kind)
    if why is None:
        return None
    model = getattr(model_config, "architecture", None) or getattr(model_config, "model", "?")
    return f"int8kv-shim: --kv-cache-dtype {kv_cache_dtype}: {model}: {why}; {_OWN_DTYPES_HINT}"


def patch_refuse_unsupported_models(arg_utils: ModuleType) -> None:
    """Refuse MLA, hybrid, attention-free and encoder models as soon as their config is known.

    ``create_model_config`` is the first point of ``create_engine_config`` where the model's
    kind is known, before any worker, weight or GPU memory: a hybrid model would otherwise start
    and size its pages wrongly, and MLA / encoder models would only fail later, at backend
    selection, with the reason buried in vLLM's "No valid attention backend" error.
    """
    if is_applied("refuse_unsupported_models"):
        return
    engine_args = getattr(arg_utils, "EngineArgs", None)
    if engine_args is None or "create_model_config" not in vars(engine_args):
        return
    ours = frozenset(dtype_names())
    original = vars(engine_args)["create_model_config"]

    def refuse(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        model_config = wrapped(*args, **kwargs)
        requested = getattr(instance, "kv_cache_dtype", None)
        if requested in ours:
            reason = unsupported_model_reason(model_config, requested)
            if reason is not None:
                raise ValueError(reason)
        return model_config

    engine_args.create_model_config = wrapt.FunctionWrapper(original, refuse)

    def undo() -> None:
        engine_args.create_model_config = original

    _UNDO["refuse_unsupported_models"] = undo


# --------------------------------------------------------------------------------------------------
# P10  vllm.engine.arg_utils: EngineArgs.create_engine_config (what int4's tail cannot honour)


def int4_config_refusal(vllm_config: Any) -> str | None:
    """The one-line refusal of an engine config a tail dtype cannot serve, or None.

    Also sets the block size the dtype needs when the user gave none. Reads ``cache_config``
    (``cache_dtype``, ``block_size``, ``user_specified_block_size``), ``speculative_config``,
    ``parallel_config`` and ``kv_transfer_config`` of vLLM's VllmConfig (a stand-in works in
    tests).
    """
    from int8kv_shim.catalogue_loader import block_size_reason, needs_tail_pool, page_tokens

    cache = vllm_config.cache_config
    dtype = cache.cache_dtype
    if not needs_tail_pool(dtype):
        return None
    prefix = f"int8kv-shim: --kv-cache-dtype {dtype}"
    if getattr(cache, "user_specified_block_size", True):
        reason = block_size_reason(dtype, cache.block_size)
        if reason is not None:
            return f"int8kv-shim: {reason}"
    else:
        cache.block_size = page_tokens(dtype) or cache.block_size
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            f"{prefix} does not support speculative decoding yet: unverified draft tokens would "
            "be quantized into its pages; drop the speculative config or use --kv-cache-dtype int8"
        )
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "use_ubatching", False):
        return (
            f"{prefix} does not support dual-batch overlap (--enable-dbo): its tail slots follow "
            "the whole batch's rows, not a micro-batch's"
        )
    for name, flag in (
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ):
        if getattr(parallel, name, 1) > 1:
            return (
                f"{prefix} does not support context parallelism ({flag} > 1): a rank would hold "
                "only part of a page, and the tail holds whole pages"
            )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return (
            f"{prefix} does not support KV connectors (--kv-transfer-config): a transferred or "
            "offloaded page would lose its unfinished tokens, which live in the tail pool"
        )
    return None


def cap_default_max_num_seqs(engine_args: Any, usage_context: Any = None) -> int | None:
    """For a dtype with a tail pool and no ``--max-num-seqs`` from the user, set
    ``engine_args.max_num_seqs`` below vLLM's default when the default's pool would take more
    than its share of the KV memory (``int8kv_shim/tail_pool_memory.py``), with a warning; the
    value set, or None. Runs before ``create_engine_config``, which derives the CUDA-graph sizes
    and the scheduler's limits from it."""
    from int8kv_shim.catalogue_loader import needs_tail_pool
    from int8kv_shim.tail_pool_memory import default_max_num_seqs

    if getattr(engine_args, "max_num_seqs", 0) is not None or not needs_tail_pool(
        getattr(engine_args, "kv_cache_dtype", None)
    ):
        return None
    from vllm.config import SchedulerConfig

    get_batch_defaults = getattr(type(engine_args), "get_batch_defaults", None)
    if get_batch_defaults is None:  # another vLLM's EngineArgs: its default stays
        return None
    world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    defaults = get_batch_defaults(world)[1]
    vllm_default = defaults.get(usage_context, SchedulerConfig.DEFAULT_MAX_NUM_SEQS)
    if getattr(engine_args, "performance_mode", None) == "throughput":
        vllm_default *= 2  # as vLLM doubles its own default
    batched = getattr(engine_args, "max_num_batched_tokens", None)
    if batched:  # as vLLM lowers its own default: no more sequences than a step's tokens
        vllm_default = min(vllm_default, batched)
    try:
        from vllm.platforms import current_platform

        total = current_platform.get_device_total_memory()
    except Exception:  # no GPU visible to this process: no estimate, vLLM's default stays
        total = None
    chosen = default_max_num_seqs(engine_args, vllm_default, total)
    if chosen is None:
        return None
    engine_args.max_num_seqs, warning = chosen
    get_logger().warning(warning)
    return engine_args.max_num_seqs


def patch_refuse_unsupported_int4_options(arg_utils: ModuleType) -> None:
    """Refuse, at start-up and in one line each, options a tail dtype cannot honour yet, and set
    its block size, and a smaller default ``max_num_seqs`` where its pool needs one
    (:func:`cap_default_max_num_seqs`), when the user gave none.

    ``create_engine_config`` is where every entry point (``vllm serve``, ``LLM(...)``,
    benchmarks) builds its config, in the front-end process before any worker starts.
    """
    if is_applied("refuse_unsupported_int4_options"):
        return
    engine_args = getattr(arg_utils, "EngineArgs", None)
    if engine_args is None or "create_engine_config" not in vars(engine_args):
        return
    original = vars(engine_args)["create_engine_config"]

    def refuse(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if instance is not None:
            usage_context = args[0] if args else kwargs.get("usage_context")
            cap_default_max_num_seqs(instance, usage_context)
        vllm_config = wrapped(*args, **kwargs)
        reason = int4_config_refusal(vllm_config)
        if reason is not None:
            raise ValueError(reason)
        return vllm_config

    engine_args.create_engine_config = wrapt.FunctionWrapper(original, refuse)

    def undo() -> None:
        engine_args.create_engine_config = original

    _UNDO["refuse_unsupported_int4_options"] = undo


# --------------------------------------------------------------------------------------------------
# P13  vllm.v1.engine.core: get_kv_cache_configs (what the tail pool costs beside the cache)


def _config_and_specs(vllm_config: Any, kv_cache_specs: Any, *_: Any, **__: Any) -> tuple:
    """(vllm_config, kv_cache_specs) of a ``get_kv_cache_configs`` call, however it was made."""
    return vllm_config, kv_cache_specs


def patch_report_tail_pool(core: ModuleType) -> None:
    """After the engine core sizes the KV cache, one line on what a tail pool (``int4``) takes of
    the KV memory (``int8kv_shim/tail_pool_memory.py``); nothing for other dtypes.

    ``EngineCore._initialize_kv_caches`` calls the module's own binding of
    ``get_kv_cache_configs`` with every worker's specs, right after the workers' memory profiling
    (which counted the pools, allocated with the model); vLLM logs ``GPU KV cache size`` inside it.
    """
    if is_applied("report_tail_pool"):
        return
    original = getattr(core, "get_kv_cache_configs", None)
    if original is None:
        return

    def then_report(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        configs = wrapped(*args, **kwargs)
        from int8kv_shim.tail_pool_memory import report

        try:
            report(*_config_and_specs(*args, **kwargs), configs)
        except Exception as exc:  # a report must never stop an engine that sized its cache
            get_logger().warning(
                "int8kv-shim: no tail-pool report (%s: %s)", type(exc).__name__, exc
            )
        return configs

    core.get_kv_cache_configs = wrapt.FunctionWrapper(original, then_report)

    def undo() -> None:
        core.get_kv_cache_configs = original

    _UNDO["report_tail_pool"] = undo


# --------------------------------------------------------------------------------------------------
# P11, P12  the model runners: the tail slots of each step's rows (int8kv_shim/tail_slots.py)
#
# Not in ACTIVE_SITES: attach_runner_hooks() applies them when the first layer with a tail pool
# is built, so the runners of every other dtype stay untouched. Each wrapper passes the call
# straight through when the process has no slot manager.

_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


def _wrap_method(cls: type, name: str, wrapper: Callable[..., Any], undo_key: str) -> None:
    original = vars(cls)[name]
    setattr(cls, name, wrapt.FunctionWrapper(original, wrapper))
    undo = _UNDO.get(undo_key)

    def restore() -> None:
        setattr(cls, name, original)
        if undo is not None:
            undo()

    _UNDO[undo_key] = restore


def _before_dummy_run(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    from int8kv_shim import tail_slots

    tail_slots.dummy_run_starts()
    return wrapped(*args, **kwargs)


def _runner_call(instance: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(runner, scheduler_output) of a runner method's call, also when called through the class."""
    if instance is None:
        instance, args = args[0], args[1:]
    return instance, kwargs["scheduler_output"] if "scheduler_output" in kwargs else args[0]


def patch_v1_runner_tail_slots(runner: ModuleType) -> None:
    """V1 ``GPUModelRunner``: slots from ``_update_states``, -1 rows for ``_dummy_run``.

    ``_update_states`` frees finished requests, removes unscheduled ones from the persistent
    batch, adds new and resumed ones, condenses it and reorders it decodes-first
    (``_may_reorder_batch``): when it returns, ``input_batch.req_ids[:num_reqs]`` is the row order
    of every block table ``_build_attention_metadata`` builds this step (nothing between them
    moves a row). ``_dummy_run`` (profiling, CUDA-graph capture, idle data-parallel steps) builds
    its metadata from the same persistent block table without calling ``_update_states``.
    """
    if is_applied("v1_runner_tail_slots"):
        return
    cls = runner.GPUModelRunner

    def after_update_states(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        result = wrapped(*args, **kwargs)
        from int8kv_shim import tail_slots

        tail_slots.v1_states_updated(*_runner_call(instance, args, kwargs))
        return result

    _wrap_method(cls, "_update_states", after_update_states, "v1_runner_tail_slots")
    _wrap_method(cls, "_dummy_run", _before_dummy_run, "v1_runner_tail_slots")


def patch_v2_runner_tail_slots(runner: ModuleType) -> None:
    """V2 ``GPUModelRunner``: frees in ``finish_requests``, rows from ``prepare_inputs``, -1 rows
    for ``_dummy_run`` and ``capture_model``.

    ``prepare_inputs`` sorts the scheduled requests by their token count (decodes first) into
    ``InputBatch.req_ids``; ``prepare_attn`` gathers the block tables in that order (through
    ``idx_mapping``), so it is the row order of the step's metadata. Dummy runs and capture build
    their batch with ``InputBatch.make_dummy`` instead, never through ``prepare_inputs``.
    """
    if is_applied("v2_runner_tail_slots"):
        return
    cls = runner.GPUModelRunner

    def after_finish_requests(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        result = wrapped(*args, **kwargs)
        from int8kv_shim import tail_slots

        tail_slots.v2_requests_finished(_runner_call(instance, args, kwargs)[1])
        return result

    def after_prepare_inputs(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        input_batch = wrapped(*args, **kwargs)
        from int8kv_shim import tail_slots

        tail_slots.v2_inputs_prepared(input_batch, _runner_call(instance, args, kwargs)[1])
        return input_batch

    _wrap_method(cls, "finish_requests", after_finish_requests, "v2_runner_tail_slots")
    _wrap_method(cls, "prepare_inputs", after_prepare_inputs, "v2_runner_tail_slots")
    _wrap_method(cls, "_dummy_run", _before_dummy_run, "v2_runner_tail_slots")
    _wrap_method(cls, "capture_model", _before_dummy_run, "v2_runner_tail_slots")


# P16  vllm.v1.worker.gpu_worker: Worker.determine_available_memory (the pool inside a given size)


def patch_worker_kv_memory_holds_tail_pool(gpu_worker: ModuleType) -> None:
    """``Worker.determine_available_memory``: with ``--kv-cache-memory-bytes`` the tail pool comes
    out of the given bytes, as it comes out of the profiled memory without it.

    vLLM returns a user's ``kv_cache_memory_bytes`` as the cache's size without profiling, so the
    pool, allocated with the model, would be memory on top of it, and the tokens the cache holds
    "in that memory" overstated. The worker loaded the model (and the pools) before vLLM calls
    this, so the process's slot manager knows their bytes.
    """
    if is_applied("worker_kv_memory_holds_tail_pool"):
        return

    def less_the_pool(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        available = wrapped(*args, **kwargs)
        worker = instance if instance is not None else args[0]
        from int8kv_shim import tail_slots

        slots = tail_slots.manager()
        given = worker.cache_config.kv_cache_memory_bytes
        if not given or slots is None or not slots.pool_bytes:
            return available  # profiled: the pool is already non-KV memory
        left = available - slots.pool_bytes
        if left <= 0:
            raise ValueError(
                f"int8kv-shim: --kv-cache-memory-bytes {given} cannot hold the tail pool of "
                f"{slots.num_slots} slots ({slots.pool_bytes} bytes) and a cache: give more "
                "bytes or a lower --max-num-seqs"
            )
        get_logger().info(
            "int8kv-shim: --kv-cache-memory-bytes %.2f GiB holds the tail pool (%.2f GiB) and "
            "the KV cache (%.2f GiB)",
            available / 2**30,
            slots.pool_bytes / 2**30,
            left / 2**30,
        )
        return left

    _wrap_method(
        gpu_worker.Worker, "determine_available_memory", less_the_pool,
        "worker_kv_memory_holds_tail_pool",
    )  # fmt: skip


RUNNER_SITES: dict[str, Callable[[ModuleType], None]] = {
    _V1_RUNNER: patch_v1_runner_tail_slots,
    _V2_RUNNER: patch_v2_runner_tail_slots,
    "vllm.v1.worker.gpu_worker": patch_worker_kv_memory_holds_tail_pool,
}


def attach_runner_hooks() -> None:
    """Hook both model runners and the worker's KV-memory sizing (now if imported, else when they
    are). Idempotent."""
    for name, apply in RUNNER_SITES.items():
        wrapt.register_post_import_hook(apply, name)


# --------------------------------------------------------------------------------------------------
# P14  vllm.v1.core.kv_cache_coordinator: find_longest_cache_hit (hits recompute the tail)


def tail_tokens_a_hit_gives_back(kv_cache_config: Any) -> int:
    """Tokens a prefix-cache hit gives back so that every page the tail holds is recomputed.

    With two tail pages (the default) the tail keeps a sequence's newest page and the one before
    it in the model's dtype, and attention reads both from there. vLLM's hit takes every full page
    but the newest, so the page before the newest would come from the 4-bit cache on a hit where
    a miss, which wrote it into the tail, reads it exact: the same prompt would attend
    differently. One page less of hit puts that page through the write kernel again, into the
    tail, for the cost of recomputing its tokens. 0 with one tail page or no tail dtype.
    """
    from int8kv_shim.catalogue_loader import needs_tail_pool
    from int8kv_shim.environment_variables import int4_tail_pages

    pages = [
        group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        if needs_tail_pool(getattr(group.kv_cache_spec, "int8kv_dtype", None))
    ]
    # the variable is read only for a tail dtype: it means nothing to the others
    return (int4_tail_pages() - 1) * max(pages) if pages else 0


def _hit_args(block_hashes: Any, max_cache_hit_length: int) -> tuple[Any, int]:
    return block_hashes, max_cache_hit_length


def patch_prefix_hit_recomputes_tail(coordinator: ModuleType) -> None:
    """``find_longest_cache_hit`` of vLLM's one-group and hybrid KV-cache coordinators: a shorter
    longest hit by :func:`tail_tokens_a_hit_gives_back` (the coordinator aligns it to its pages).

    ``KVCacheManager.get_computed_blocks`` asks it for every request that starts or resumes after
    preemption, with at most ``num_tokens - 1`` tokens; nothing else in vLLM 0.24 asks it on the
    paths a tail dtype allows (the hybrid coordinator's per-group lookup serves KV connectors,
    which ``int4`` refuses).
    """
    if is_applied("prefix_hit_recomputes_tail"):
        return

    # wrapt passes the coordinator as instance also when the method is called through the class
    def shorten_hit(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        give_back = tail_tokens_a_hit_gives_back(instance.kv_cache_config)
        if give_back == 0:
            return wrapped(*args, **kwargs)
        block_hashes, longest = _hit_args(*args, **kwargs)
        return wrapped(block_hashes, max(0, longest - give_back))

    for name in ("UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator"):
        cls = getattr(coordinator, name, None)
        if cls is not None and "find_longest_cache_hit" in vars(cls):
            _wrap_method(cls, "find_longest_cache_hit", shorten_hit, "prefix_hit_recomputes_tail")


# --------------------------------------------------------------------------------------------------
# P15  vllm.v1.worker.gpu_model_runner: the decodes-first reorder skipped on decode-only steps
#
# Not in ACTIVE_SITES: the builder of our backend applies it (attach_reorder_hook), so the runner of
# a BF16 or upstream-dtype engine stays untouched.


def patch_v1_runner_decode_only_reorder(runner: ModuleType) -> None:
    """V1 ``GPUModelRunner._may_reorder_batch``: returns at once when every request is a decode
    (:func:`int8kv_shim.batch_reorder.is_decode_only`), where vLLM's reorder would move nothing."""
    from int8kv_shim.batch_reorder import is_decode_only  # bound once: the wrapper runs every step

    if is_applied("v1_runner_decode_only_reorder"):
        return

    def skip_when_decode_only(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        runner_, scheduler_output = _runner_call(instance, args, kwargs)
        if is_decode_only(runner_.input_batch, scheduler_output, runner_.reorder_batch_threshold):
            return None
        return wrapped(*args, **kwargs)

    _wrap_method(
        runner.GPUModelRunner, "_may_reorder_batch", skip_when_decode_only,
        "v1_runner_decode_only_reorder",
    )  # fmt: skip


def attach_reorder_hook() -> None:
    """Apply P15 (now if V1's runner is imported, else when it is). Idempotent."""
    wrapt.register_post_import_hook(patch_v1_runner_decode_only_reorder, _V1_RUNNER)


# --------------------------------------------------------------------------------------------------
# Guards: the inert mode, for any vLLM but the supported one


def guard_create_engine_config(arg_utils: ModuleType) -> None:
    """Fail ``EngineArgs.create_engine_config`` with our message when one of our dtypes is asked.

    That method is where every entry point (``vllm serve``, ``LLM(...)``, benchmarks) builds the
    CacheConfig whose pydantic validator would otherwise reject the name generically.
    """
    if is_applied("guard_create_engine_config"):
        return
    engine_args = getattr(arg_utils, "EngineArgs", None)
    if engine_args is None or "create_engine_config" not in vars(engine_args):
        return
    ours = frozenset(dtype_names())
    original = vars(engine_args)["create_engine_config"]

    def refuse_our_dtypes(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        requested = getattr(instance, "kv_cache_dtype", None)
        if requested in ours:
            check = _inert_because[0] if _inert_because else check_vllm_version()
            raise UnsupportedVLLMVersionError(requested, check)
        return wrapped(*args, **kwargs)

    engine_args.create_engine_config = wrapt.FunctionWrapper(original, refuse_our_dtypes)

    def undo() -> None:
        engine_args.create_engine_config = original

    _UNDO["guard_create_engine_config"] = undo


def guard_cli_choices(arg_utils: ModuleType) -> None:
    """Let ``--kv-cache-dtype <ours>`` through argparse so the error above can explain itself.

    Without this, the CLI would stop at argparse's "invalid choice" first. Only the argparse
    ``choices`` that ``EngineArgs.add_cli_args`` gets from ``get_kwargs(CacheConfig)`` (a fresh
    copy per call) are widened; CacheConfig itself still rejects the name, through our guard.
    """
    if is_applied("guard_cli_choices"):
        return
    original = getattr(arg_utils, "get_kwargs", None)
    if original is None:
        return
    names = dtype_names()

    def add_our_choices(
        wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        result = wrapped(*args, **kwargs)
        choices = result.get("cache_dtype", {}).get("choices") if isinstance(result, dict) else None
        if isinstance(choices, list):
            choices.extend(n for n in names if n not in choices)
        return result

    arg_utils.get_kwargs = wrapt.FunctionWrapper(original, add_our_choices)

    def undo() -> None:
        arg_utils.get_kwargs = original

    _UNDO["guard_cli_choices"] = undo


# --------------------------------------------------------------------------------------------------
# Which functions run when which module is imported. Order within a module matters (P1 before its
# dependents); across modules vLLM's own import order decides, and each function copes with it.

ACTIVE_SITES: dict[str, tuple[Callable[[ModuleType], None], ...]] = {
    "vllm.utils.torch_utils": (patch_str_dtype_to_torch_dtype,),
    "vllm.config.cache": (patch_cache_dtype_literal,),
    "vllm.engine.arg_utils": (
        patch_cli_choices_cache,
        patch_refuse_unsupported_models,
        patch_refuse_unsupported_int4_options,
    ),
    "vllm.v1.attention.backends.registry": (patch_register_backend,),
    "vllm.v1.attention.selector": (patch_selector_cache_dtype,),
    "vllm.platforms.cuda": (patch_backend_priorities,),
    "vllm.model_executor.layers.attention.attention": (
        patch_kv_cache_spec,
        patch_static_scales_loader,
    ),
    "vllm.v1.engine.core": (patch_report_tail_pool,),
    "vllm.v1.core.kv_cache_coordinator": (patch_prefix_hit_recomputes_tail,),
}

GUARD_SITES: dict[str, tuple[Callable[[ModuleType], None], ...]] = {
    "vllm.engine.arg_utils": (guard_create_engine_config, guard_cli_choices),
}

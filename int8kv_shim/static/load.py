"""Serving side of ``int8_static``: load the calibration file into each layer's impl (patch P8).

Runs inside ``Attention.process_weights_after_loading`` (after vLLM's own code, which resets
``_k_scale``/``_v_scale`` to 1.0: we never use those), in every worker, during ``load_model``, so
before profiling and CUDA-graph capture. Anything wrong stops start-up with one line naming the file
and the problem; there is no fall-back scale.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from int8kv_shim.catalogue_loader import load_catalogue
from int8kv_shim.static import file as scales_file
from int8kv_shim.static.file import ScalesFile, ScalesFileError

_lock = threading.Lock()
# Resolved path -> parsed file: every layer of a process reads the file once.
_cache: dict[Path, ScalesFile] = {}


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def load_cached(path: Path, how: str = "") -> ScalesFile:
    key = path.resolve() if path.exists() else path.absolute()
    with _lock:
        scales = _cache.get(key)
        if scales is None:
            scales = _cache[key] = scales_file.load(path, how)
        return scales


def _tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _model_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        raise RuntimeError(
            "int8kv-shim: --kv-cache-dtype int8_static: no vLLM config is current while loading "
            "weights, so the model (and its calibration file) is unknown"
        )
    return config.model_config


def _layer_device(layer: torch.nn.Module) -> torch.device:
    for tensor in layer.buffers():
        return tensor.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_into_layer(layer: Any) -> None:
    """Give ``layer.impl`` its static K/V scales for this TP rank (``int8_static`` layers only)."""
    if getattr(layer, "kv_cache_dtype", None) != load_catalogue().STATIC_DTYPE:
        return
    from vllm.model_executor.models.utils import extract_layer_index

    model_config = _model_config()
    path, how = scales_file.find(str(model_config.model), os.environ)
    scales = load_cached(path, how)
    scales_file.check_model(
        scales,
        path,
        num_layers=model_config.get_total_num_hidden_layers(),
        num_kv_heads=model_config.get_total_num_kv_heads(),
        head_dim=model_config.get_head_size(),
    )
    try:
        index = extract_layer_index(layer.layer_name)
    except (AssertionError, ValueError) as exc:
        raise ScalesFileError(
            f"int8kv-shim: calibration file {path}: cannot tell the layer index of attention "
            f"layer {layer.layer_name!r} ({exc})"
        ) from exc
    if index not in scales.layers:
        raise ScalesFileError(
            f"int8kv-shim: calibration file {path}: has no layer {index} "
            f"(attention layer {layer.layer_name})"
        )
    tp_rank, tp_size = _tp_rank_and_size()
    try:
        k_scale, v_scale = scales_file.scales_for_rank(scales, index, tp_size, tp_rank)
    except ValueError as exc:
        raise ScalesFileError(f"int8kv-shim: calibration file {path}: {exc}") from exc
    impl = layer.impl
    if len(k_scale) != impl.num_kv_heads:
        raise ScalesFileError(
            f"int8kv-shim: calibration file {path}: layer {index} gets {len(k_scale)} kv heads "
            f"on TP rank {tp_rank} of {tp_size}, but the layer has {impl.num_kv_heads}"
        )
    device = _layer_device(layer)
    impl.set_static_scales(
        torch.tensor(k_scale, dtype=torch.float32, device=device),
        torch.tensor(v_scale, dtype=torch.float32, device=device),
        scales.v_format,
        source=str(path),
    )

"""Recording K/V statistics for ``int8kv calibrate``, and merging them across vLLM workers.

How a calibration run flows (``int8kv_shim/static/cli.py`` drives it):

1. ``int8kv calibrate`` sets ``INT8KV_CALIBRATE`` in its environment before starting vLLM, so every
   vLLM process (engine core, each TP/PP worker) inherits it. Each :class:`Int8KVAttentionImpl`
   then holds this process's :class:`Recorder` (:func:`active_recorder`).
2. vLLM starts with ``worker_extension_cls`` = :class:`CalibrationWorkerExtension`, which adds two
   methods to every worker; ``LLM.collective_rpc`` calls them by name (plain msgpack, no pickled
   callables): ``int8kv_calibration_start`` arms the recorders (so start-up's dummy and warm-up
   runs are not counted), ``int8kv_calibration_collect`` returns each worker's statistics per
   (kv-head, channel) as plain lists, tagged with its TP rank and size.
3. While armed, ``do_kv_cache_update`` passes each layer's K and V (after RoPE, exactly what the
   cache receives) to :meth:`Recorder.record`, which folds them into on-device maxima per (kv-head,
   channel) (and optionally log-spaced histograms) with no host synchronisation.
4. :func:`merge_worker_stats` (pure Python) places every worker's local heads at their global
   indices (:func:`int8kv_shim.static.file.heads_for_rank`), so TP and PP runs give one file.

Each rank sees every token of the heads it holds, so a percentile is computed on the worker from
its own histogram; merging only places values (taking the max where TP replicates a head).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from int8kv_shim.environment_variables import INT8KV_CALIBRATE
from int8kv_shim.static.file import heads_for_rank

# Log-spaced histogram of |x|: BINS_PER_OCTAVE bins per power of two over [2^LOG2_MIN, 2^LOG2_MAX).
# A percentile read from it is the upper edge of its bin, i.e. at most 2^(1/64) - 1 = 1.09% high
# (never low), and never above the exact absmax, which is tracked separately.
LOG2_MIN = -24
LOG2_MAX = 24
BINS_PER_OCTAVE = 64
NUM_BINS = (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE

RECORD_MODES = ("absmax", "histogram")


# --------------------------------------------------------------------------------------------------
# Statistics math (torch, device-agnostic; tested on CPU)


def bin_index(x_abs: torch.Tensor) -> torch.Tensor:
    """Histogram bin (int64) of each non-negative value; zeros and underflow go to bin 0."""
    b = torch.floor((torch.log2(x_abs.float()) - LOG2_MIN) * BINS_PER_OCTAVE)
    b = torch.nan_to_num(b, nan=0.0, neginf=0.0, posinf=float(NUM_BINS - 1))
    return b.clamp_(0, NUM_BINS - 1).long()


def bin_upper_edge(index: torch.Tensor) -> torch.Tensor:
    return torch.exp2(LOG2_MIN + (index.double() + 1) / BINS_PER_OCTAVE)


def percentile_from_histogram(
    hist: torch.Tensor, absmax: torch.Tensor, percentile: float
) -> torch.Tensor:
    """Per-row ``percentile`` (0-100) of |x| from ``hist`` [rows, NUM_BINS], capped at ``absmax``.

    The value returned for a row is the upper edge of the first bin whose cumulative count reaches
    ``ceil(percentile / 100 * total)``: an upper bound, within one bin, of the exact percentile.
    """
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], not {percentile}")
    hist = hist.to(torch.float64)
    total = hist.sum(dim=-1)
    target = torch.clamp(torch.ceil(total * (percentile / 100.0)), min=1.0)
    cum = hist.cumsum(dim=-1)
    first = (cum < target.unsqueeze(-1)).sum(dim=-1).clamp(max=NUM_BINS - 1)
    return torch.minimum(bin_upper_edge(first), absmax.to(torch.float64))


# --------------------------------------------------------------------------------------------------
# The recorder (one per process)


@dataclass
class _LayerStats:
    k_max: torch.Tensor  # fp32 [H, D]
    v_max: torch.Tensor
    tokens: torch.Tensor  # int64 scalar
    # int32 [H, D, NUM_BINS]: a count per (kv-head, channel) of at most the calibration's tokens;
    # int32 halves what 64-bit counts would hold (12 KiB per channel, K and V of every layer)
    k_hist: torch.Tensor | None
    v_hist: torch.Tensor | None


class Recorder:
    """Per-layer statistics per (kv-head, channel) of the K and V written to the cache, kept on
    device."""

    def __init__(self, histogram: bool = False) -> None:
        self.histogram = histogram
        self.armed = False
        self.layers: dict[str, _LayerStats] = {}

    def reset(self) -> None:
        self.layers.clear()

    def record(
        self, layer_name: str, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Fold one batch in: key/value [tokens, kv_heads, head_dim]; slots < 0 are padding."""
        n = min(key.shape[0], value.shape[0], slot_mapping.shape[0])
        if n == 0:
            return
        valid = (slot_mapping[:n] >= 0).view(n, 1, 1)
        k = torch.where(valid, key[:n].abs().float(), 0.0)
        v = torch.where(valid, value[:n].abs().float(), 0.0)
        stats = self.layers.get(layer_name)
        if stats is None:
            stats = self.layers[layer_name] = self._new(key.shape[1], key.shape[2], key.device)
        torch.maximum(stats.k_max, k.amax(dim=0), out=stats.k_max)
        torch.maximum(stats.v_max, v.amax(dim=0), out=stats.v_max)
        stats.tokens += valid.sum()
        if stats.k_hist is not None and stats.v_hist is not None:
            weight = valid.expand_as(k).to(stats.k_hist.dtype).reshape(-1)
            # one histogram per (kv-head, channel): row h * D + d of the flattened counts
            rows = k.shape[1] * k.shape[2]
            offsets = (torch.arange(rows, device=k.device) * NUM_BINS).view(1, *k.shape[1:])
            for data, hist in ((k, stats.k_hist), (v, stats.v_hist)):
                index = (bin_index(data) + offsets).reshape(-1)
                hist.view(-1).index_add_(0, index, weight)

    def _new(self, num_heads: int, head_dim: int, device: torch.device) -> _LayerStats:
        def hist() -> torch.Tensor | None:
            if not self.histogram:
                return None
            return torch.zeros(num_heads, head_dim, NUM_BINS, dtype=torch.int32, device=device)

        return _LayerStats(
            k_max=torch.zeros(num_heads, head_dim, dtype=torch.float32, device=device),
            v_max=torch.zeros(num_heads, head_dim, dtype=torch.float32, device=device),
            tokens=torch.zeros((), dtype=torch.int64, device=device),
            k_hist=hist(),
            v_hist=hist(),
        )

    def summary(self, percentile: float | None = None) -> dict[str, dict[str, Any]]:
        """``{layer_name: {"k": [H][D], "v": [H][D], "tokens": n}}`` as plain Python (one host
        sync): each (kv-head, channel)'s absmax, or its ``percentile`` of |x|."""
        out: dict[str, dict[str, Any]] = {}
        for name, stats in self.layers.items():
            if percentile is None or percentile == 100:
                k, v = stats.k_max, stats.v_max
            else:
                if stats.k_hist is None or stats.v_hist is None:
                    raise RuntimeError(
                        "a percentile needs histograms: set INT8KV_CALIBRATE=histogram"
                    )
                k = _channel_percentile(stats.k_hist, stats.k_max, percentile)
                v = _channel_percentile(stats.v_hist, stats.v_max, percentile)
            out[name] = {
                "k": k.double().cpu().tolist(),
                "v": v.double().cpu().tolist(),
                "tokens": int(stats.tokens.item()),
            }
        return out


def _channel_percentile(
    hist: torch.Tensor, absmax: torch.Tensor, percentile: float
) -> torch.Tensor:
    """:func:`percentile_from_histogram` of each (kv-head, channel): hist [H, D, NUM_BINS],
    absmax [H, D] -> [H, D]."""
    rows = percentile_from_histogram(hist.reshape(-1, NUM_BINS), absmax.reshape(-1), percentile)
    return rows.view(absmax.shape)


_recorder: Recorder | None = None


def active_recorder(environ: Mapping[str, str] | None = None) -> Recorder | None:
    """This process's recorder when ``INT8KV_CALIBRATE`` is set (by ``int8kv calibrate``)."""
    global _recorder
    env = os.environ if environ is None else environ
    mode = env.get(INT8KV_CALIBRATE, "").strip().lower()
    if not mode:
        return None
    if mode not in RECORD_MODES:
        raise ValueError(f"{INT8KV_CALIBRATE}={mode!r}: expected one of {', '.join(RECORD_MODES)}")
    if _recorder is None:
        _recorder = Recorder(histogram=mode == "histogram")
    return _recorder


class CalibrationWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``) by ``int8kv calibrate``."""

    def int8kv_calibration_start(self) -> bool:
        recorder = active_recorder()
        if recorder is None:
            raise RuntimeError(f"int8kv-shim: {INT8KV_CALIBRATE} is not set in this worker")
        recorder.reset()
        recorder.armed = True
        return True

    def int8kv_calibration_collect(self, percentile: float | None = None) -> dict[str, Any]:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        recorder = active_recorder()
        if recorder is None:
            raise RuntimeError(f"int8kv-shim: {INT8KV_CALIBRATE} is not set in this worker")
        recorder.armed = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {
            "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
            "layers": recorder.summary(percentile),
        }


# --------------------------------------------------------------------------------------------------
# Merging across workers (pure Python)


def layer_index(layer_name: str) -> int:
    """The layer number in ``model.layers.3.self_attn.attn`` (its only integer), as vLLM's
    ``extract_layer_index`` reads it for one attention module per layer."""
    numbers = [int(part) for part in layer_name.split(".") if re.fullmatch(r"\d+", part)]
    if len(numbers) != 1:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return numbers[0]


def merge_worker_stats(
    results: Iterable[Mapping[str, Any]], total_kv_heads: int, num_layers: int
) -> tuple[dict[int, tuple[str, list[list[float]], list[list[float]]]], int]:
    """Per-layer ``(name, k_stat[total][D], v_stat[total][D])`` and the token count, from every
    worker's :meth:`CalibrationWorkerExtension.int8kv_calibration_collect` result."""
    k: dict[int, list[list[float] | None]] = {}
    v: dict[int, list[list[float] | None]] = {}
    names: dict[int, str] = {}
    tokens = 0
    for result in results:
        heads = heads_for_rank(total_kv_heads, int(result["tp_size"]), int(result["tp_rank"]))
        for name, stats in result["layers"].items():
            index = layer_index(name)
            if names.setdefault(index, name) != name:
                raise ValueError(f"two attention layers have index {index}: {names[index]}, {name}")
            if len(stats["k"]) != len(heads) or len(stats["v"]) != len(heads):
                raise ValueError(
                    f"{name}: rank {result['tp_rank']} of {result['tp_size']} reported "
                    f"{len(stats['k'])} heads, expected {len(heads)}"
                )
            tokens = max(tokens, int(stats["tokens"]))
            for merged, local in ((k, stats["k"]), (v, stats["v"])):
                row = merged.setdefault(index, [None] * total_kv_heads)
                for head, channels in zip(heads, local, strict=True):
                    values = [float(x) for x in channels]
                    previous = row[head]
                    if previous is not None:  # a head TP replicates: the max per channel
                        if len(previous) != len(values):
                            raise ValueError(f"{name}: kv head {head} reported with two sizes")
                        values = [max(a, b) for a, b in zip(previous, values, strict=True)]
                    row[head] = values
    missing = [i for i in range(num_layers) if i not in names]
    if missing:
        raise ValueError(f"no statistics for layers {missing} (of {num_layers})")
    out: dict[int, tuple[str, list[list[float]], list[list[float]]]] = {}
    for index in range(num_layers):
        k_row, v_row = k[index], v[index]
        if any(x is None for x in k_row) or any(x is None for x in v_row):
            raise ValueError(f"layer {index}: some kv heads were reported by no worker")
        out[index] = (names[index], _heads(k_row), _heads(v_row))
    extra = sorted(set(names) - set(range(num_layers)))
    if extra:
        raise ValueError(f"statistics for layers {extra} beyond num_layers {num_layers}")
    return out, tokens


def _heads(values: Sequence[list[float] | None]) -> list[list[float]]:
    return [list(x) if x is not None else [math.nan] for x in values]

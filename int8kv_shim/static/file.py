"""The ``int8_static`` calibration file: K and V scales per (layer, kv-head, channel), as JSON.

Written by ``int8kv calibrate``, read at serving start-up (patch P8, :mod:`int8kv_shim.static.load`).
Pure Python (no vLLM, no torch), so everything here is tested on CPU.

The file holds the **total** number of kv heads, not one rank's: :func:`heads_for_rank` slices it
the way vLLM shards (or replicates) kv heads over tensor-parallel ranks, so one file serves TP=1, 2,
4, ... An example (one layer of two shown, two kv heads of head_dim 64, channels elided)::

    {
      "format": "int8kv-scales",
      "format_version": 2,
      "model": "/models/SmolLM2-135M-Instruct",
      "num_layers": 2,
      "num_kv_heads": 2,
      "head_dim": 64,
      "v_format": "int8",
      "statistic": "absmax",
      "num_tokens": 32768,
      "layers": {
        "0": {"name": "model.layers.0.self_attn.attn",
              "k_stat": [[12.5, 0.75, ...], [9.75, 1.5, ...]],
              "v_stat": [[0.81, 0.5, ...], [1.2, 0.25, ...]],
              "k_scale": [[0.0984251968503937, 0.005905511811023622, ...], [...]],
              "v_scale": [[0.006377952755905512, 0.003937007874015748, ...], [...]]},
        ...
      }
    }

Each of ``k_stat``, ``v_stat``, ``k_scale``, ``v_scale`` is num_kv_heads lists of head_dim numbers:
one per channel, since K has outlier channels that a per-head scale would let set every channel's
step. ``k_scale = k_stat / 127`` (K is INT8); ``v_scale = v_stat / 127`` for ``v_format: int8``
and ``v_stat / 448`` for ``v_format: e4m3`` (V stored as FP8-E4M3, whose largest finite value is
448). Files of format version 1 (one number per kv head in each list, written before per-channel
scales) still load: each head's scale serves every channel of it.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from int8kv_shim._logging import get_logger
from int8kv_shim.catalogue_loader import load_catalogue

_catalogue = load_catalogue()

FORMAT_NAME = "int8kv-scales"
FORMAT_VERSION = 2
# version 1: one scale per (layer, kv-head), read as that scale for each of the head's channels
PER_HEAD_VERSION = 1
READ_VERSIONS = (PER_HEAD_VERSION, FORMAT_VERSION)
DEFAULT_FILENAME = "int8kv_scales.json"

# K of int8_static is int8 codes; V's storage format says its own largest magnitude. The
# statistic maps onto that value.
K_QMAX: float = _catalogue.get_dtype(_catalogue.STATIC_DTYPE).qmax
V_QMAX: dict[str, float] = {name: f.qmax for name, f in _catalogue.V_FORMAT_CATALOGUE.items()}
V_FORMATS: tuple[str, ...] = _catalogue.V_FORMATS

# A head whose calibration values were all zero still needs a positive scale; any tiny value
# works (zeros quantize to zero under every scale).
MIN_STAT = 1e-6

_STATISTIC = re.compile(r"^(absmax|p(\d+(\.\d+)?))$")


class ScalesFileError(ValueError):
    """A calibration file that cannot be used; the message is one line, naming the file."""


# [num_kv_heads][head_dim]: one value per (kv-head, channel)
PerChannel = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class LayerScales:
    index: int
    name: str
    k_stat: PerChannel
    v_stat: PerChannel
    k_scale: PerChannel
    v_scale: PerChannel


@dataclass(frozen=True)
class ScalesFile:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_format: str
    statistic: str
    num_tokens: int
    layers: dict[int, LayerScales] = field(default_factory=dict)
    # the version the file was read from; PER_HEAD_VERSION: every channel has its head's scale.
    # Written, it is always FORMAT_VERSION (the values are per channel either way).
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "v_format": self.v_format,
            "statistic": self.statistic,
            "num_tokens": self.num_tokens,
            "layers": {
                str(i): {
                    "name": layer.name,
                    "k_stat": [list(h) for h in layer.k_stat],
                    "v_stat": [list(h) for h in layer.v_stat],
                    "k_scale": [list(h) for h in layer.k_scale],
                    "v_scale": [list(h) for h in layer.v_scale],
                }
                for i, layer in sorted(self.layers.items())
            },
        }


def statistic_name(percentile: float | None) -> str:
    """``"absmax"`` or ``"p99.9"``-style for a percentile in (0, 100)."""
    if percentile is None or percentile == 100:
        return "absmax"
    if not 0 < percentile < 100:
        raise ValueError(f"percentile must be in (0, 100], not {percentile}")
    return f"p{percentile:g}"


def build(
    *,
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    v_format: str,
    statistic: str,
    num_tokens: int,
    stats: Mapping[int, tuple[str, Sequence[Sequence[float]], Sequence[Sequence[float]]]],
) -> ScalesFile:
    """A file from per-layer ``(name, k_stat[num_kv_heads][head_dim], v_stat[...][...])``."""
    if v_format not in V_QMAX:
        raise ValueError(f"v_format must be one of {', '.join(V_FORMATS)}, not {v_format!r}")
    if sorted(stats) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(stats))
        raise ValueError(f"statistics missing for layers {missing} (of {num_layers})")
    layers = {}
    for index, (name, k_stat, v_stat) in stats.items():
        for stat in (k_stat, v_stat):
            if len(stat) != num_kv_heads or any(len(head) != head_dim for head in stat):
                raise ValueError(
                    f"layer {index}: expected {num_kv_heads} kv heads x {head_dim} channels "
                    "of statistics"
                )
        k = tuple(tuple(max(float(x), MIN_STAT) for x in head) for head in k_stat)
        v = tuple(tuple(max(float(x), MIN_STAT) for x in head) for head in v_stat)
        if not all(math.isfinite(x) for head in k + v for x in head):
            raise ValueError(f"layer {index} ({name}): non-finite K/V statistic")
        layers[index] = LayerScales(
            index=index,
            name=name,
            k_stat=k,
            v_stat=v,
            k_scale=tuple(tuple(x / K_QMAX for x in head) for head in k),
            v_scale=tuple(tuple(x / V_QMAX[v_format] for x in head) for head in v),
        )
    return ScalesFile(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_format=v_format,
        statistic=statistic,
        num_tokens=num_tokens,
        layers=layers,
    )


def write(path: str | os.PathLike[str], scales: ScalesFile) -> Path:
    """Write ``scales`` as indented JSON (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(scales.to_json(), indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------------------------------
# Reading and validation


def _error(path: Path | str, problem: str) -> ScalesFileError:
    return ScalesFileError(f"int8kv-shim: calibration file {path}: {problem}")


def load(path: str | os.PathLike[str], how: str = "") -> ScalesFile:
    """Read and check a calibration file; :class:`ScalesFileError` names the file and the problem.

    Checks everything the file can say about itself (version, shape, finite and positive scales);
    :func:`check_model` then compares it with the running model. ``how`` (e.g. "from
    INT8KV_SCALES") goes into the message for a missing file.
    """
    path = Path(path)
    if not path.exists():
        where = f" ({how})" if how else ""
        raise _error(
            path,
            f"does not exist{where}; --kv-cache-dtype int8_static needs one: create it with "
            f"`int8kv calibrate MODEL` (writes MODEL/{DEFAULT_FILENAME}) or set INT8KV_SCALES",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _error(path, f"cannot be read ({reason})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _error(
            path, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise _error(path, f'is not an int8kv scales file (no "format": "{FORMAT_NAME}")')
    version = data.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise _error(
            path,
            f"has format version {version!r}; this int8kv-shim reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))} (re-run `int8kv calibrate`)",
        )
    scales = _parse(path, data, version)
    if version == PER_HEAD_VERSION:
        get_logger().info(
            "int8kv-shim: calibration file %s has one scale per kv head (format version %d), "
            "used for every channel of it; re-running `int8kv calibrate` gives per-channel scales",
            path,
            version,
        )
    return scales


def _parse(path: Path, data: dict[str, Any], version: int) -> ScalesFile:
    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _error(path, f"field {key!r} is missing or not {_kind_name(kind)}")
        return value

    model = need("model", str)
    num_layers = need("num_layers", int)
    num_kv_heads = need("num_kv_heads", int)
    head_dim = need("head_dim", int)
    v_format = need("v_format", str)
    statistic = need("statistic", str)
    num_tokens = need("num_tokens", int)
    raw_layers = need("layers", dict)
    if v_format not in V_QMAX:
        raise _error(path, f"v_format {v_format!r} is not one of {', '.join(V_FORMATS)}")
    if not _STATISTIC.match(statistic):
        raise _error(path, f"statistic {statistic!r} is not 'absmax' or 'pNN.N'")
    for key, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise _error(path, f"{key} is {value}; it must be >= 1")
    expected = [str(i) for i in range(num_layers)]
    if sorted(raw_layers, key=_layer_sort_key) != expected:
        raise _error(
            path,
            f"layers are {_summarize(sorted(raw_layers, key=_layer_sort_key))}, "
            f"expected 0..{num_layers - 1} (num_layers {num_layers})",
        )
    layers = {}
    for key in expected:
        entry = raw_layers[key]
        index = int(key)
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise _error(path, f"layer {index} has no name")
        values: dict[str, PerChannel] = {}
        for what in ("k_stat", "v_stat", "k_scale", "v_scale"):
            label = f"layer {index} ({name}) {what}"
            raw = entry.get(what)
            if version == PER_HEAD_VERSION:
                if not isinstance(raw, list) or len(raw) != num_kv_heads:
                    raise _error(
                        path, f"{label} must be a list of num_kv_heads = {num_kv_heads} numbers"
                    )
                # each head's number, checked, serves every channel of the head
                values[what] = tuple(
                    (_number(path, f"{label}[{h}]", x, what),) * head_dim for h, x in enumerate(raw)
                )
                continue
            if (
                not isinstance(raw, list)
                or len(raw) != num_kv_heads
                or not all(isinstance(h, list) and len(h) == head_dim for h in raw)
            ):
                raise _error(
                    path,
                    f"{label} must be a list of num_kv_heads = {num_kv_heads} lists of "
                    f"head_dim = {head_dim} numbers",
                )
            values[what] = tuple(
                tuple(_number(path, f"{label}[{h}][{c}]", x, what) for c, x in enumerate(head))
                for h, head in enumerate(raw)
            )
        layers[index] = LayerScales(index=index, name=name, **values)
    return ScalesFile(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_format=v_format,
        statistic=statistic,
        num_tokens=num_tokens,
        layers=layers,
        format_version=version,
    )


def _number(path: Path, label: str, x: Any, what: str) -> float:
    """``x`` as a float, refused unless a number (and, for a scale, finite and > 0)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _error(path, f"{label} is not a number")
    x = float(x)
    if what.endswith("scale") and not (math.isfinite(x) and x > 0):
        raise _error(path, f"{label} is {x!r}; scales must be finite and > 0")
    return x


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", dict: "a JSON object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _layer_sort_key(key: str) -> tuple[int, int | str]:
    return (0, int(key)) if key.isdigit() else (1, key)


def _summarize(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys) if len(keys) <= 6 else f"{', '.join(keys[:3])}, ..., {keys[-1]}"


def check_model(
    scales: ScalesFile,
    path: str | os.PathLike[str],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Refuse a file made for another model (layer count, total kv heads, head_dim)."""
    for what, theirs, ours in (
        ("layers", scales.num_layers, num_layers),
        ("kv heads", scales.num_kv_heads, num_kv_heads),
        ("head_dim", scales.head_dim, head_dim),
    ):
        if theirs != ours:
            label = f"head_dim {theirs}" if what == "head_dim" else f"{theirs} {what}"
            mine = f"head_dim {ours}" if what == "head_dim" else f"{ours}"
            raise _error(
                path,
                f"was made for another model ({scales.model}): it has {label}, "
                f"the running model has {mine}",
            )


# --------------------------------------------------------------------------------------------------
# Tensor parallelism


def heads_for_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The global kv-head indices rank ``tp_rank`` of ``tp_size`` holds, as vLLM shards them.

    ``total >= tp``: a contiguous partition of ``total / tp`` heads per rank. ``total < tp``: each
    rank holds one head, replicated over ``tp / total`` consecutive ranks
    (``QKVParallelLinear``: ``shard = rank // num_kv_head_replicas``).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} kv heads cannot be split over {tp_size} TP ranks")
        per_rank = total_kv_heads // tp_size
        return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    if tp_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} kv heads cannot be replicated over {tp_size} TP ranks")
    replicas = tp_size // total_kv_heads
    return [tp_rank // replicas]


def scales_for_rank(
    scales: ScalesFile, layer_index: int, tp_size: int, tp_rank: int
) -> tuple[list[list[float]], list[list[float]]]:
    """``(k_scale, v_scale)`` of one layer for one TP rank, each ``[num_kv_heads_local][head_dim]``
    (the channels of each head this rank holds)."""
    layer = scales.layers[layer_index]
    heads = heads_for_rank(scales.num_kv_heads, tp_size, tp_rank)
    return [list(layer.k_scale[h]) for h in heads], [list(layer.v_scale[h]) for h in heads]


# --------------------------------------------------------------------------------------------------
# Where the file is


def find(model: str, environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The calibration file to use and how it was found (for messages).

    ``INT8KV_SCALES`` wins; otherwise ``<model_dir>/int8kv_scales.json``.
    """
    from int8kv_shim.environment_variables import INT8KV_SCALES

    env = os.environ if environ is None else environ
    explicit = env.get(INT8KV_SCALES, "").strip()
    if explicit:
        return Path(explicit).expanduser(), f"from {INT8KV_SCALES}"
    return Path(model).expanduser() / DEFAULT_FILENAME, (
        f"next to the model ({INT8KV_SCALES} unset)"
    )

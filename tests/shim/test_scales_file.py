"""The int8_static calibration file: round trip, every refusal (exact messages), TP slicing."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from int8kv_shim.static import file as scales_file
from int8kv_shim.static.file import ScalesFileError, heads_for_rank, scales_for_rank

HEAD_DIM = 4


def make(
    num_layers: int = 3, num_kv_heads: int = 2, v_format: str = "int8"
) -> scales_file.ScalesFile:
    # channel c of head h: K 10 (layer + 1) + h + 100 c (channels 100x apart), V 0.5 (layer + 1)
    # + h + c
    stats = {
        i: (
            f"model.layers.{i}.self_attn.attn",
            [[10.0 * (i + 1) + h + 100 * c for c in range(HEAD_DIM)] for h in range(num_kv_heads)],
            [[0.5 * (i + 1) + h + c for c in range(HEAD_DIM)] for h in range(num_kv_heads)],
        )
        for i in range(num_layers)
    }
    return scales_file.build(
        model="/models/tiny",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        v_format=v_format,
        statistic="absmax",
        num_tokens=4096,
        stats=stats,
    )


@pytest.mark.parametrize("v_format", ["int8", "e4m3"])
def test_round_trip_and_scales(tmp_path: Path, v_format: str) -> None:
    original = make(v_format=v_format)
    path = scales_file.write(tmp_path / "s.json", original)
    loaded = scales_file.load(path)
    assert loaded == original
    data = json.loads(path.read_text())  # human-readable JSON, layers keyed by index
    assert data["format"] == "int8kv-scales" and data["format_version"] == 2
    assert data["layers"]["1"]["name"] == "model.layers.1.self_attn.attn"
    assert data["layers"]["1"]["k_scale"][1] == [(21.0 + 100 * c) / 127 for c in range(HEAD_DIM)]
    v_max = 127.0 if v_format == "int8" else 448.0
    layer = loaded.layers[2]  # one scale per (kv-head, channel)
    assert layer.k_scale == tuple(
        tuple((30.0 + h + 100 * c) / 127 for c in range(HEAD_DIM)) for h in range(2)
    )
    assert layer.v_scale == tuple(
        tuple((1.5 + h + c) / v_max for c in range(HEAD_DIM)) for h in range(2)
    )
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temp file left behind


def test_zero_statistic_gets_a_tiny_positive_scale() -> None:
    built = scales_file.build(
        model="m", num_layers=1, num_kv_heads=1, head_dim=2, v_format="int8",
        statistic="absmax", num_tokens=1, stats={0: ("l.0", [[0.0, 1.0]], [[2.0, 0.0]])},
    )  # fmt: skip
    assert built.layers[0].k_scale[0][0] > 0 and built.layers[0].v_scale[0][1] > 0
    with pytest.raises(ValueError, match="expected 1 kv heads x 2 channels"):
        scales_file.build(
            model="m", num_layers=1, num_kv_heads=1, head_dim=2, v_format="int8",
            statistic="absmax", num_tokens=1, stats={0: ("l.0", [[1.0]], [[2.0, 1.0]])},
        )  # fmt: skip


def test_statistic_name() -> None:
    assert scales_file.statistic_name(None) == "absmax"
    assert scales_file.statistic_name(100) == "absmax"
    assert scales_file.statistic_name(99.9) == "p99.9"
    with pytest.raises(ValueError):
        scales_file.statistic_name(0)


def _write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def _good(tmp_path: Path) -> dict:
    return make().to_json()


def test_refuses_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path, "from INT8KV_SCALES")
    assert str(exc.value) == (
        f"int8kv-shim: calibration file {path}: does not exist (from INT8KV_SCALES); "
        "--kv-cache-dtype int8_static needs one: create it with `int8kv calibrate MODEL` "
        "(writes MODEL/int8kv_scales.json) or set INT8KV_SCALES"
    )


def test_refuses_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "dir.json"
    path.mkdir()  # exists, cannot be read as a file
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert (
        str(exc.value) == f"int8kv-shim: calibration file {path}: cannot be read (Is a directory)"
    )


def test_refuses_corrupt_json(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"format": "int8kv-scales", "layers": {')
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == (
        f"int8kv-shim: calibration file {path}: is not valid JSON "
        "(Expecting property name enclosed in double quotes at line 1 column 40)"
    )


def test_refuses_other_json(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "s.json", {"k_scale": 1.0})
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == (
        f'int8kv-shim: calibration file {path}: is not an int8kv scales file (no "format": '
        '"int8kv-scales")'
    )


def test_refuses_a_wrong_version(tmp_path: Path) -> None:
    data = _good(tmp_path)
    data["format_version"] = 3
    path = _write_json(tmp_path / "s.json", data)
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == (
        f"int8kv-shim: calibration file {path}: has format version 3; this int8kv-shim reads "
        "versions 1 and 2 (re-run `int8kv calibrate`)"
    )


def _per_head_file(tmp_path: Path) -> dict:
    """A file as format version 1 wrote it: one number per kv head in each list."""
    data = _good(tmp_path)
    data["format_version"] = 1
    for layer in data["layers"].values():
        for what in ("k_stat", "v_stat", "k_scale", "v_scale"):
            layer[what] = [max(head) for head in layer[what]]
    return data


def test_a_per_head_file_loads_with_its_heads_scale_on_every_channel(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_json(tmp_path / "old.json", _per_head_file(tmp_path))
    # the shim's logger is vLLM's child (which may not propagate) once vLLM is imported
    monkeypatch.setattr(scales_file, "get_logger", lambda: logging.getLogger("int8kv_shim.t"))
    with caplog.at_level(logging.INFO, logger="int8kv_shim.t"):
        loaded = scales_file.load(path)
    assert loaded.format_version == 1 and loaded.head_dim == HEAD_DIM
    head_max = (30.0 + 1 + 100 * (HEAD_DIM - 1)) / 127  # layer 2, head 1: its largest channel
    assert loaded.layers[2].k_scale[1] == (head_max,) * HEAD_DIM
    k, _ = scales_for_rank(loaded, 2, 2, 1)
    assert k == [[head_max] * HEAD_DIM]
    assert [r.getMessage() for r in caplog.records] == [
        f"int8kv-shim: calibration file {path} has one scale per kv head (format version 1), "
        "used for every channel of it; re-running `int8kv calibrate` gives per-channel scales"
    ]
    # written again, it is a per-channel (version 2) file with the same scales
    again = scales_file.load(scales_file.write(tmp_path / "new.json", loaded))
    assert again.format_version == 2 and again.layers == loaded.layers


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["layers"]["0"]["k_scale"].pop(),
            "layer 0 (model.layers.0.self_attn.attn) k_scale must be a list of num_kv_heads = 2 "
            "numbers",
        ),
        (
            lambda d: d["layers"]["1"]["v_scale"].__setitem__(1, 0.0),
            "layer 1 (model.layers.1.self_attn.attn) v_scale[1] is 0.0; scales must be finite "
            "and > 0",
        ),
        (
            lambda d: d["layers"]["0"]["k_stat"].__setitem__(0, "big"),
            "layer 0 (model.layers.0.self_attn.attn) k_stat[0] is not a number",
        ),
    ],
)
def test_refuses_malformed_per_head_files(tmp_path: Path, edit, message: str) -> None:
    data = _per_head_file(tmp_path)
    edit(data)
    path = _write_json(tmp_path / "s.json", data)
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == f"int8kv-shim: calibration file {path}: {message}"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_layers", 30, "it has 3 layers, the running model has 30"),
        ("num_kv_heads", 8, "it has 2 kv heads, the running model has 8"),
        ("head_dim", 128, "it has head_dim 4, the running model has head_dim 128"),
    ],
)
def test_refuses_a_file_for_another_model(
    tmp_path: Path, field: str, value: int, message: str
) -> None:
    path = scales_file.write(tmp_path / "s.json", make())
    model = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 64, field: value}
    with pytest.raises(ScalesFileError) as exc:
        scales_file.check_model(scales_file.load(path), path, **model)
    assert str(exc.value) == (
        f"int8kv-shim: calibration file {path}: was made for another model (/models/tiny): "
        + message
    )


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (0.0, "0.0"), (-0.25, "-0.25")],
)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_refuses_non_finite_or_non_positive_scales(
    tmp_path: Path, bad: float, shown: str, which: str
) -> None:
    data = _good(tmp_path)
    data["layers"]["1"][which][1][3] = bad
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))  # json writes NaN / Infinity, which Python reads back
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == (
        f"int8kv-shim: calibration file {path}: layer 1 (model.layers.1.self_attn.attn) "
        f"{which}[1][3] is {shown}; scales must be finite and > 0"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["layers"].pop("2"), "layers are 0, 1, expected 0..2 (num_layers 3)"),
        (
            lambda d: d["layers"]["0"]["k_scale"].pop(),
            "layer 0 (model.layers.0.self_attn.attn) k_scale must be a list of num_kv_heads = 2 "
            "lists of head_dim = 4 numbers",
        ),
        (
            lambda d: d["layers"]["0"]["k_stat"][1].pop(),
            "layer 0 (model.layers.0.self_attn.attn) k_stat must be a list of num_kv_heads = 2 "
            "lists of head_dim = 4 numbers",
        ),
        (
            lambda d: d["layers"]["0"]["v_scale"].__setitem__(0, 0.5),
            "layer 0 (model.layers.0.self_attn.attn) v_scale must be a list of num_kv_heads = 2 "
            "lists of head_dim = 4 numbers",
        ),
        (
            lambda d: d["layers"]["0"]["v_scale"][0].__setitem__(2, "big"),
            "layer 0 (model.layers.0.self_attn.attn) v_scale[0][2] is not a number",
        ),
        (lambda d: d.__setitem__("head_dim", 0), "head_dim is 0; it must be >= 1"),
        (lambda d: d.pop("head_dim"), "field 'head_dim' is missing or not an integer"),
        (lambda d: d.__setitem__("v_format", "fp4"), "v_format 'fp4' is not one of int8, e4m3"),
    ],
)
def test_refuses_malformed_files(tmp_path: Path, edit, message: str) -> None:
    data = _good(tmp_path)
    edit(data)
    path = _write_json(tmp_path / "s.json", data)
    with pytest.raises(ScalesFileError) as exc:
        scales_file.load(path)
    assert str(exc.value) == f"int8kv-shim: calibration file {path}: {message}"


# --------------------------------------------------------------------------------------------------
# Tensor parallelism


@pytest.mark.parametrize(
    ("total", "tp", "expected"),
    [
        (8, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (2, 1, [[0, 1]]),
        (2, 2, [[0], [1]]),
        (2, 4, [[0], [0], [1], [1]]),  # replicated: vLLM's shard = rank // (tp // total)
        (1, 4, [[0], [0], [0], [0]]),
    ],
)
def test_heads_for_rank(total: int, tp: int, expected: list[list[int]]) -> None:
    assert [heads_for_rank(total, tp, rank) for rank in range(tp)] == expected
    if total < tp:  # the brief's formula for the replicated case agrees
        assert [[rank * total // tp] for rank in range(tp)] == expected


def test_heads_for_rank_refuses_uneven_splits() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        heads_for_rank(6, 4, 0)
    with pytest.raises(ValueError, match="cannot be replicated"):
        heads_for_rank(3, 4, 0)


@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_one_file_serves_tp_1_2_4(tmp_path: Path, num_kv_heads: int) -> None:
    loaded = scales_file.load(scales_file.write(tmp_path / "s.json", make(2, num_kv_heads)))
    full_k, full_v = scales_for_rank(loaded, 1, 1, 0)
    assert full_k == [list(h) for h in loaded.layers[1].k_scale] and len(full_k) == num_kv_heads
    assert all(len(h) == HEAD_DIM for h in full_k + full_v)
    for tp in (2, 4):
        per_rank = [scales_for_rank(loaded, 1, tp, rank) for rank in range(tp)]
        if num_kv_heads >= tp:  # partitioned: the ranks' slices concatenate to the whole
            assert sum((k for k, _ in per_rank), []) == full_k
            assert sum((v for _, v in per_rank), []) == full_v
        else:  # replicated: one head each, the head vLLM gives that rank
            assert [k for k, _ in per_rank] == [[full_k[r * num_kv_heads // tp]] for r in range(tp)]


def test_find_prefers_int8kv_scales_env(tmp_path: Path) -> None:
    explicit = tmp_path / "elsewhere.json"
    assert scales_file.find(str(tmp_path), {"INT8KV_SCALES": str(explicit)}) == (
        explicit,
        "from INT8KV_SCALES",
    )
    assert scales_file.find(str(tmp_path), {}) == (
        tmp_path / "int8kv_scales.json",
        "next to the model (INT8KV_SCALES unset)",
    )

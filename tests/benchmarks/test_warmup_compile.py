"""benchmarks/warmup_compile.py: each row a fresh process with its own empty Triton cache and
thread count; a row that fails says why, and the run exits non-zero."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import warmup_compile


def test_each_row_runs_in_its_own_process_with_an_empty_cache(monkeypatch, tmp_path) -> None:
    seen = []
    real_run = subprocess.run

    def fake_run(argv, env=None, **kw):
        if argv[0] == "git":  # the result's commit stamp
            return real_run(argv, **kw)
        cache = Path(env["TRITON_CACHE_DIR"])
        seen.append((json.loads(argv[-1]), env["INT8KV_COMPILE_THREADS"], cache, cache.exists()))
        out = (
            json.dumps({"warmup_s": 1.5, "launches": 28})
            if env["INT8KV_COMPILE_THREADS"] == "1"
            else ""
        )
        return subprocess.CompletedProcess(argv, 0 if out else 1, out, "RuntimeError: no GPU\n")

    monkeypatch.setattr(warmup_compile.subprocess, "run", fake_run)
    monkeypatch.setattr(warmup_compile, "gpu_name", lambda: "test GPU")
    out = tmp_path / "w.json"
    rc = warmup_compile.main(["--models", "gemma3", "--dtypes", "int4", "--threads", "1,8",
                              "--out", str(out)])  # fmt: skip
    assert rc == 1  # the 8-thread row failed
    assert [(s[0], s[1], s[3]) for s in seen] == [
        ({"model": "gemma3", "dtype": "int4"}, "1", True),
        ({"model": "gemma3", "dtype": "int4"}, "8", True),
    ]
    assert seen[0][2] != seen[1][2] and not any(s[2].exists() for s in seen)  # removed after
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "test GPU" and doc["cpus"] >= 1
    first, second = doc["rows"]
    assert first["threads"] == 1 and first["warmup_s"] == 1.5 and first["launches"] == 28
    assert second == {"model": "gemma3", "dtype": "int4", "threads": 8,
                      "error": "RuntimeError: no GPU"}  # fmt: skip


def test_unknown_models_and_dtypes_are_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        warmup_compile.main(["--models", "gemma3,llama", "--dtypes", "int8_fp8",
                             "--out", str(tmp_path / "w.json")])  # fmt: skip
    assert not (tmp_path / "w.json").exists()


def test_without_a_gpu_the_pool_builds_what_one_at_a_time_builds() -> None:
    # Triton's real compiles of the warm-up's variants for sm80, in its thread pool and not
    one, two = (warmup_compile.run_row("smollm2", "int8", t, 600, sm80=True) for t in (1, 2))
    assert "error" not in one and "error" not in two, (one, two)
    assert one["launches"] == two["launches"] > 0
    assert two["binaries"] == one["binaries"] > 0  # a compile failed in the pool would be missing

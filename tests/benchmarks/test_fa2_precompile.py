"""benchmarks/fa2_precompile.py without a GPU: its variant matrix and its child commands."""

from __future__ import annotations

import pytest

from benchmarks import fa2_precompile as fp


def test_variants_cover_every_kind_of_each_shape_of_the_bundles_models() -> None:
    got = fp.variants(["smollm2", "gemma3"])
    shapes = {(nq, nkv, d, w) for nq, nkv, d, w, _ in got}
    # Gemma 3's full-attention and sliding-window layers are separate kernel variants
    assert shapes == {(9, 3, 64, 0), (4, 1, 256, 0), (4, 1, 256, 512)}
    assert len(got) == len(shapes) * len(fp.KINDS) == len(set(got))
    assert {k for *_, k in got} == {"dense", "paged_prefill", "decode1", "decode8", "decode32",
                                    "decode128"}  # fmt: skip


def test_unknown_model_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown model 'llama'"):
        fp.variants(["llama"])


def test_dry_run_prints_one_child_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp.main(["--models", "smollm2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(fp.KINDS)
    assert lines[0].endswith("-m benchmarks.fa2_precompile --one 9 3 64 0 dense")


def test_a_variant_needs_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fp.main(["--one", "9", "3", "64", "0", "dense"])


def test_failed_variants_are_reported_with_their_error(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert fp.main(["--models", "smollm2", "--jobs", "6"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len([ln for ln in lines if "needs a CUDA GPU" in ln]) == len(fp.KINDS), lines
    assert lines[-1].startswith(f"fa2_precompile: {len(fp.KINDS)} variants in ")
    assert lines[-1].endswith(f"{len(fp.KINDS)} failed")
    assert len(list((tmp_path / "logs").glob("fa2_precompile_*.log"))) == len(fp.KINDS)

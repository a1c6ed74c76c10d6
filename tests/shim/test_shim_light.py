"""Shim behaviour that needs no vLLM import: activation switch, version check, import cost, CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from int8kv_shim import cli, package
from int8kv_shim.environment_variables import activation_requested, is_truthy

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "On", " on "])
def test_truthy_values_activate(value: str) -> None:
    assert is_truthy(value)
    assert activation_requested({"INT8KV_SHIM": value})


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "off", "2", "enable"])
def test_other_values_do_not_activate(value: str | None) -> None:
    env = {} if value is None else {"INT8KV_SHIM": value}
    assert not activation_requested(env)


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.24.0", True),
        ("0.24.0+cu129", True),
        ("0.23.0", False),
        ("0.25.0", False),
        ("0.24.1", False),
        ("0.24.0rc1", False),
        ("0.24.0.post1", False),
        ("0.24.1.dev3+g1234abc", False),
        (None, False),
    ],
)
def test_supported_version_is_exactly_the_pinned_release(
    version: str | None, supported: bool
) -> None:
    assert package.is_supported_version(version) is supported


def test_supported_version_matches_the_pyproject_pin() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"vllm=={package.SUPPORTED_VLLM_VERSION}"' in pyproject


@pytest.mark.parametrize("shim", [None, "1"])
def test_import_imports_neither_vllm_nor_torch(run_python, shim: str | None) -> None:
    code = (
        "import sys, json\n"
        "import int8kv_shim, int8kv_shim.plugin\n"
        "int8kv_shim.plugin.register()\n"
        "from int8kv_shim.catalogue_loader import dtype_names\n"
        "names = dtype_names()\n"
        "heavy = [m for m in ('vllm', 'torch', 'triton', 'int8kv_kernels') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'mode': int8kv_shim.mode(), 'names': list(names)}))\n"
    )
    run = run_python(code, shim=shim)
    assert run.returncode == 0, run.output
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["mode"] == ("active" if shim else "off")
    assert result["names"]


def test_catalogue_loaded_early_is_the_one_the_kernels_import(run_python) -> None:
    code = (
        "import sys\n"
        "from int8kv_shim.catalogue_loader import load_catalogue\n"
        "early = load_catalogue()\n"
        "assert 'int8kv_kernels' not in sys.modules\n"
        "import int8kv_kernels.catalogue as late\n"
        "import int8kv_kernels\n"
        "assert early is late is int8kv_kernels.catalogue, (early, late)\n"
        "print('same')\n"
    )
    run = run_python(code, shim=None)
    assert run.returncode == 0 and "same" in run.stdout, run.output


def _doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["doctor", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_doctor_reports_everything(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    monkeypatch.delenv("INT8KV_PREFILL", raising=False)
    code, out = _doctor(capsys)
    assert f"int8kv-shim   {package.shim_version()}" in out
    assert f"(supported: {package.SUPPORTED_VLLM_VERSION}): ok" in out
    assert "activation    on (INT8KV_SHIM=1" in out
    from int8kv_kernels.catalogue import DTYPE_NAMES

    assert f"dtypes        {', '.join(DTYPE_NAMES)} registered" in out
    gpu, _ = cli.detect_gpu()
    if gpu is None:
        assert "GPU           no GPU: kernels cannot run here" in out
        assert code == 0  # nothing was asked for that cannot work
    for name in DTYPE_NAMES:
        assert re.search(rf"^  {name}\s+(yes|no: .+)$", out, re.M), out
    assert "prefill       flash (INT8KV_PREFILL)" in out


def test_doctor_refuses_an_unknown_prefill_mode(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    monkeypatch.setenv("INT8KV_PREFILL", "fa3")
    code, out = _doctor(capsys)
    assert code == 1 and "PROBLEM: int8kv-shim: INT8KV_PREFILL='fa3' is not one of" in out


def test_doctor_fails_for_an_asked_dtype_that_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    code, out = _doctor(capsys, "--dtype", "int8")
    line = re.search(r"^  int8\s+(.+)$", out, re.M).group(1)
    assert code == (0 if line == "yes" else 1), out
    if cli.detect_gpu()[0] is None:
        assert "PROBLEM: --kv-cache-dtype int8 cannot work here: no GPU" in out


def test_doctor_fails_when_activation_is_off_and_a_dtype_is_asked(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.delenv("INT8KV_SHIM", raising=False)
    code, out = _doctor(capsys)
    assert code == 0 and "activation    off" in out and "none registered" in out
    code, out = _doctor(capsys, "--dtype", "int4")
    assert code == 1 and "set INT8KV_SHIM=1" in out


@pytest.mark.parametrize("fake", ["0.23.0", "0.25.0", "0.24.1", None])
def test_doctor_fails_when_activated_on_an_unsupported_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys, fake: str | None
) -> None:
    monkeypatch.setattr(package, "installed_vllm_version", lambda: fake)
    monkeypatch.setenv("INT8KV_SHIM", "1")
    code, out = _doctor(capsys)
    assert code == 1
    assert "NOT SUPPORTED" in out
    assert f"pip install vllm=={package.SUPPORTED_VLLM_VERSION}" in out
    assert ("not installed" if fake is None else f"vLLM {fake} is installed") in out
    # Without activation, an unsupported vLLM is no problem: nothing was asked of the shim.
    monkeypatch.delenv("INT8KV_SHIM")
    code, _ = _doctor(capsys)
    assert code == 0


def test_readme_dtype_table_matches_the_catalogue() -> None:
    readme = (REPO / "README.md").read_text()
    assert cli.dtypes_table(128) in readme, "regenerate the README table with `int8kv dtypes`"


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("", True), ("1", True), ("0", False), (" OFF ", False)]
)
def test_on_unless_switched_off_variables(value: str | None, on: bool) -> None:
    from int8kv_shim.environment_variables import direct_launch_enabled, int4_rotation_enabled

    for name, parse in (("INT8KV_INT4_ROTATION", int4_rotation_enabled),
                        ("INT8KV_DIRECT_LAUNCH", direct_launch_enabled)):  # fmt: skip
        env = {} if value is None else {name: value}
        assert parse(env) is on, name

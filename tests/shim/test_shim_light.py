"""Shim behaviour that needs no vLLM import: activation switch, version check, import cost, CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def test_doctor_refuses_an_unknown_int4_tail_page_count(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "3")
    code, out = _doctor(capsys)
    assert (
        code == 1 and "PROBLEM: int8kv-shim: INT8KV_INT4_TAIL_PAGES='3' is not one of 1, 2" in out
    )


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
@pytest.mark.parametrize("name", ["INT8KV_DIRECT_LAUNCH", "INT8KV_INT4_SINK_PAGE"])
def test_on_unless_switched_off_variables(name: str, value: str | None, on: bool) -> None:
    from int8kv_shim.environment_variables import direct_launch_enabled, int4_sink_page_enabled

    read = {
        "INT8KV_DIRECT_LAUNCH": direct_launch_enabled,
        "INT8KV_INT4_SINK_PAGE": int4_sink_page_enabled,
    }
    env = {} if value is None else {name: value}
    assert read[name](env) is on


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_int4_sink_page_refuses_other_values(value: str) -> None:
    from int8kv_shim.environment_variables import int4_sink_page_enabled

    with pytest.raises(ValueError, match=r"INT8KV_INT4_SINK_PAGE=.* is not one of 0, 1, false"):
        int4_sink_page_enabled({"INT8KV_INT4_SINK_PAGE": value})


def test_doctor_says_what_int4_keeps_in_bf16_and_refuses_a_bad_sink_switch(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    monkeypatch.delenv("INT8KV_INT4_TAIL_PAGES", raising=False)
    monkeypatch.delenv("INT8KV_INT4_SINK_PAGE", raising=False)
    code, out = _doctor(capsys)
    assert "int4 in BF16  each sequence's newest 2 pages and first page" in out
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "1")
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "off")
    code, out = _doctor(capsys)
    assert "int4 in BF16  each sequence's newest 1 page (" in out
    monkeypatch.setenv("INT8KV_INT4_SINK_PAGE", "maybe")
    code, out = _doctor(capsys)
    assert code == 1 and "PROBLEM: int8kv-shim: INT8KV_INT4_SINK_PAGE='maybe' is not one of" in out
    # both switches wrong: both named
    monkeypatch.setenv("INT8KV_INT4_TAIL_PAGES", "3")
    code, out = _doctor(capsys)
    assert (
        code == 1 and "INT8KV_INT4_TAIL_PAGES='3'" in out and "INT8KV_INT4_SINK_PAGE='maybe'" in out
    )
    assert "int4 in BF16" not in out


def test_doctor_says_how_many_compiles_run_at_once_and_refuses_a_bad_count(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("INT8KV_SHIM", "1")
    monkeypatch.setenv("INT8KV_COMPILE_THREADS", "3")
    code, out = _doctor(capsys)
    assert "compiles      3 kernel variants at a time at start-up (INT8KV_COMPILE_THREADS)" in out
    monkeypatch.setenv("INT8KV_COMPILE_THREADS", "many")
    code, out = _doctor(capsys)
    assert code == 1 and "PROBLEM: int8kv-shim: INT8KV_COMPILE_THREADS='many' is not a" in out


@pytest.mark.parametrize(("value", "pages"), [(None, 2), ("", 2), ("1", 1), (" 2 ", 2)])
def test_int4_tail_pages(value: str | None, pages: int) -> None:
    from int8kv_shim.environment_variables import int4_tail_pages

    env = {} if value is None else {"INT8KV_INT4_TAIL_PAGES": value}
    assert int4_tail_pages(env) == pages


@pytest.mark.parametrize("value", ["0", "3", "two", "on"])
def test_int4_tail_pages_refuses_other_values(value: str) -> None:
    from int8kv_shim.environment_variables import int4_tail_pages

    with pytest.raises(ValueError, match=r"INT8KV_INT4_TAIL_PAGES=.* is not one of 1, 2"):
        int4_tail_pages({"INT8KV_INT4_TAIL_PAGES": value})


def test_compile_threads(monkeypatch) -> None:
    import os

    from int8kv_shim.environment_variables import MAX_DEFAULT_COMPILE_THREADS, compile_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(40)))
    assert compile_threads({}) == compile_threads({"INT8KV_COMPILE_THREADS": " "}) == 16
    assert MAX_DEFAULT_COMPILE_THREADS == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert compile_threads({}) == 2
    assert compile_threads({"INT8KV_COMPILE_THREADS": " 1 "}) == 1
    assert compile_threads({"INT8KV_COMPILE_THREADS": "24"}) == 24


@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_compile_threads_refuses_other_values(value: str) -> None:
    from int8kv_shim.environment_variables import compile_threads

    with pytest.raises(ValueError, match=r"INT8KV_COMPILE_THREADS=.* is not a positive integer"):
        compile_threads({"INT8KV_COMPILE_THREADS": value})


# --------------------------------------------------------------------------------------------------
# int8kv run

# Runs under `int8kv run`: what was imported before this code's first line, and a grandchild's view.
_RUN_PROBE = """
import json, os, subprocess, sys
shim = sys.modules.get("int8kv_shim")
grandchild = subprocess.run(
    [sys.executable, "-c", "import sys; print('int8kv_shim' in sys.modules)"],
    capture_output=True, text=True, check=True,
).stdout.strip()
print(json.dumps({
    "imported_at_start": shim is not None,
    "mode": shim.mode() if shim else None,
    "sitecustomize": sys.modules["sitecustomize"].__file__,
    "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep),
    "shim_env": os.environ.get("INT8KV_SHIM"),
    "vllm_or_torch": sorted({"vllm", "torch"} & set(sys.modules)),
    "grandchild_imported_at_start": grandchild,
}))
"""


def _int8kv(*args: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("INT8KV_SHIM", "VLLM_PLUGINS")}
    if pythonpath is not None:
        inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *inherited])
    return subprocess.run(
        [sys.executable, "-m", "int8kv_shim.cli", *args],
        cwd=cwd,  # outside the checkout: the installed package's own sitecustomize
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_activates_the_shim_in_the_command_and_its_children(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(
        "import sys\nprint('user sitecustomize ran', file=sys.stderr)\n"
    )
    proc = _int8kv(
        "run", "--", sys.executable, "-c", _RUN_PROBE, cwd=tmp_path, pythonpath=str(user)
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["imported_at_start"] and got["grandchild_imported_at_start"] == "True"
    assert got["mode"] == ("active" if package.check_vllm_version().supported else "inert")
    # the installed package's folder first (this process may import the checkout's copy), the
    # user's PYTHONPATH kept after it, and the user's sitecustomize, shadowed by the shim's, ran
    autoload, kept = got["pythonpath"][:2]
    assert Path(autoload).parts[-2:] == ("int8kv_shim", "_autoload") and kept == str(user)
    assert Path(got["sitecustomize"]) == Path(autoload) / "sitecustomize.py"
    assert "user sitecustomize ran" in proc.stderr
    assert got["shim_env"] == "1" and got["vllm_or_torch"] == []


def test_run_refuses_a_missing_command(tmp_path: Path) -> None:
    missing = _int8kv("run", "--", "no-such-command-int8kv", cwd=tmp_path)
    assert missing.returncode == 127
    assert "int8kv run: command not found: no-such-command-int8kv" in missing.stderr
    none = _int8kv("run", cwd=tmp_path)
    assert none.returncode == 2 and "int8kv run: no command given" in none.stderr


def test_run_passes_the_command_through_untouched_and_nests() -> None:
    args = cli.parse_args(["run", "python", "-c", "x", "--", "--kv-cache-dtype", "int8"])
    assert args.command_argv == ["python", "-c", "x", "--", "--kv-cache-dtype", "int8"]
    assert cli.parse_args(["run", "--", "vllm", "serve", "--help"]).command_argv == [
        "vllm", "serve", "--help"
    ]  # fmt: skip
    env = cli.activation_env({"PYTHONPATH": "/a", "INT8KV_SHIM": "0"})
    assert env["INT8KV_SHIM"] == "1"
    assert env["PYTHONPATH"] == os.pathsep.join([str(cli.AUTOLOAD_DIR), "/a"])
    assert cli.activation_env(env) == env  # `int8kv run` inside `int8kv run`: one entry
    assert cli.activation_env({})["PYTHONPATH"] == str(cli.AUTOLOAD_DIR)

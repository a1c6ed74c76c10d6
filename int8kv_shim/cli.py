"""``int8kv``: the shim's command line.

``int8kv doctor`` checks whether the shim can do what the user wants on this machine (it also runs
where there is no GPU); ``int8kv dtypes`` prints the dtype table (the README's table is this output);
``int8kv calibrate MODEL`` writes the ``int8_static`` calibration file (needs a GPU; see
:mod:`int8kv_shim.static.cli`); ``int8kv run -- COMMAND ...`` runs a command with the shim active
in every Python process of it, through the ``sitecustomize`` shipped in the package
(``int8kv_shim/_autoload/``), so no checkout is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from int8kv_shim.catalogue_loader import load_catalogue
from int8kv_shim.environment_variables import (
    INT8KV_COMPILE_THREADS,
    INT8KV_INT4_SINK_PAGE,
    INT8KV_INT4_TAIL_PAGES,
    INT8KV_PREFILL,
    INT8KV_SHIM,
    TRUTHY_VALUES,
    activation_requested,
    compile_threads,
    int4_sink_page_enabled,
    int4_tail_pages,
    prefill_mode,
)
from int8kv_shim.package import SUPPORTED_VLLM_VERSION, check_vllm_version, shim_version
from int8kv_shim.static import cli as calibrate

MIN_COMPUTE_CAPABILITY = (8, 0)  # same bound as backend.MIN_COMPUTE_CAPABILITY (no vLLM import)
# Holds the sitecustomize that `int8kv run` puts on PYTHONPATH.
AUTOLOAD_DIR = Path(__file__).resolve().parent / "_autoload"


@dataclass(frozen=True)
class GPUInfo:
    name: str
    capability: tuple[int, int]
    count: int


def detect_gpu() -> tuple[GPUInfo | None, str]:
    """The first visible CUDA GPU, or None and why not."""
    try:
        import torch
    except ImportError:
        return None, "no GPU: torch is not installed"
    try:
        if not torch.cuda.is_available():
            return None, "no GPU: kernels cannot run here"
        major, minor = torch.cuda.get_device_capability(0)
        info = GPUInfo(torch.cuda.get_device_name(0), (major, minor), torch.cuda.device_count())
    except Exception as exc:  # a broken driver must not crash the diagnosis
        return None, f"no GPU: CUDA is unusable here ({exc})"
    return info, ""


def _missing_kernels(name: str) -> str | None:
    # Imports vLLM, torch and triton: called only when everything else says the dtype could run.
    from int8kv_shim.attention_impl import missing_kernels

    return missing_kernels(name)


def doctor(args: argparse.Namespace) -> int:
    catalogue = load_catalogue()
    problems: list[str] = []
    out = print

    out(f"int8kv-shim   {shim_version()}")

    check = check_vllm_version()
    vllm_state = "ok" if check.supported else "NOT SUPPORTED"
    out(
        f"vLLM          {check.installed or 'not installed'} "
        f"(supported: {SUPPORTED_VLLM_VERSION}): {vllm_state}"
    )

    active = activation_requested()
    raw = os.environ.get(INT8KV_SHIM)
    setting = f"{INT8KV_SHIM}={raw}" if raw is not None else f"{INT8KV_SHIM} unset"
    out(
        f"activation    {'on' if active else 'off'} ({setting}; on = {'/'.join(sorted(TRUTHY_VALUES))})"
    )
    if active and not check.supported:
        problems.append(
            f"{INT8KV_SHIM} is set but {check.describe()}: the shim stays inactive; "
            f"pip install vllm=={SUPPORTED_VLLM_VERSION}, or unset {INT8KV_SHIM}"
        )

    registered = active and check.supported
    if registered:
        out(f"dtypes        {', '.join(catalogue.DTYPE_NAMES)} registered")
    else:
        why = "activation off" if not active else "vLLM unsupported"
        out(f"dtypes        none registered ({why})")

    gpu, no_gpu_reason = detect_gpu()
    if gpu is None:
        out(f"GPU           {no_gpu_reason}")
    else:
        major, minor = gpu.capability
        count = f" (+{gpu.count - 1} more)" if gpu.count > 1 else ""
        out(f"GPU           {gpu.name}, compute capability {major}.{minor}{count}")

    try:
        mode = prefill_mode()
        how = {
            "flash": (
                "prefills (first chunks; continuations of more than 256 tokens with their context "
                "gathered from the cache) on vLLM's FlashAttention-2 where it runs, the rest on ours"
            ),
            "triton": "every token on our kernels",
        }[mode]
        out(f"prefill       {mode} ({INT8KV_PREFILL}): {how}")
    except ValueError as e:
        problems.append(str(e))
    # read when an int4 layer allocates its tail: refused here first, each bad one named
    int4_switches = []
    for read in (int4_tail_pages, int4_sink_page_enabled):
        try:
            int4_switches.append(read())
        except ValueError as e:
            problems.append(str(e))
    if len(int4_switches) == 2:
        pages, sink = int4_switches
        kept = f"newest {pages} page{'s' * (pages > 1)}" + (" and first page" if sink else "")
        switches = f"{INT8KV_INT4_TAIL_PAGES}, {INT8KV_INT4_SINK_PAGE}"
        out(f"int4 in BF16  each sequence's {kept} ({switches})")
    try:
        threads = compile_threads()
        out(
            f"compiles      {threads} kernel variants at a time at start-up ({INT8KV_COMPILE_THREADS})"
        )
    except ValueError as e:
        problems.append(str(e))

    out("can run here:")
    for name in catalogue.DTYPE_NAMES:
        reason = _why_not(name, active, check.supported, gpu)
        out(f"  {name:<12}  {'yes' if reason is None else 'no: ' + reason}")
        if reason is not None and name in (args.dtype or ()):
            problems.append(f"--kv-cache-dtype {name} cannot work here: {reason}")

    for problem in problems:
        out(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _why_not(name: str, active: bool, vllm_ok: bool, gpu: GPUInfo | None) -> str | None:
    if not vllm_ok:
        return f"needs vLLM {SUPPORTED_VLLM_VERSION}"
    if not active:
        return f"set {INT8KV_SHIM}=1"
    if gpu is None:
        return "no GPU"
    if gpu.capability < MIN_COMPUTE_CAPABILITY:
        major, minor = MIN_COMPUTE_CAPABILITY
        return f"needs compute capability >= {major}.{minor}, this GPU is {gpu.capability[0]}.{gpu.capability[1]}"
    return _missing_kernels(name)


def dtypes_table(head_size: int) -> str:
    """The Markdown table of our dtypes, computed from the catalogue."""
    catalogue = load_catalogue()
    bf16 = 2 * 2 * head_size
    lines = [
        f"| `--kv-cache-dtype` | bits | scales | bytes per token and KV head (K+V, head size "
        f"{head_size}) | tokens per GiB vs BF16 | format |",
        "|---|---|---|---|---|---|",
        f"| (BF16, vLLM's `auto`) | 16 | none | {bf16} | 1.00x | |",
    ]
    for entry in catalogue.CATALOGUE.values():
        scales = entry.scale_kind.replace("_", " ")
        # a dtype that groups only larger heads shows no group at a head size it keeps whole
        grouped = entry.grouped_above is None or head_size > entry.grouped_above
        if entry.group_size is not None and grouped:
            scales += f" ({entry.group_size} elements)"
        if entry.has_zero_point:
            scales += ", with zero point"
        lines.append(
            f"| `{entry.name}` | {entry.bits} | {scales} | "
            f"{entry.bytes_per_token_head(head_size)} | {entry.capacity_vs_bf16(head_size):.2f}x "
            f"| {entry.description} |"
        )
    return "\n".join(lines)


def print_dtypes(args: argparse.Namespace) -> int:
    print(dtypes_table(args.head_size))
    return 0


def activation_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the shim switched on and its ``sitecustomize`` folder first on
    ``PYTHONPATH`` (the user's entries kept after it, once only when runs nest)."""
    env = dict(environ)
    env[INT8KV_SHIM] = "1"
    user = env.get("PYTHONPATH", "")
    if user.split(os.pathsep)[0] != str(AUTOLOAD_DIR):
        env["PYTHONPATH"] = os.pathsep.join([str(AUTOLOAD_DIR), *([user] if user else [])])
    return env


def run_command(args: argparse.Namespace) -> int:
    """Replace this process with the command (exec: its exit status is the command's own); an
    exit status only when it cannot be started, as a shell gives."""
    command = args.command_argv
    if not command:
        print("int8kv run: no command given (int8kv run -- COMMAND [ARGS ...])", file=sys.stderr)
        return 2
    try:
        os.execvpe(command[0], command, activation_env(os.environ))
    except FileNotFoundError:
        print(f"int8kv run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"int8kv run: cannot execute {command[0]}: permission denied", file=sys.stderr)
        return 126


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="int8kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_doctor = sub.add_parser(
        "doctor",
        help="check versions, activation and GPU; non-zero exit when what you ask for cannot work",
    )
    p_doctor.add_argument(
        "--dtype",
        action="append",
        choices=load_catalogue().DTYPE_NAMES,
        help="a KV-cache dtype you intend to use (repeatable): fail unless it can run here",
    )
    p_doctor.set_defaults(func=doctor)

    p_dtypes = sub.add_parser("dtypes", help="print the table of KV-cache dtypes (Markdown)")
    p_dtypes.add_argument("--head-size", type=int, default=128)
    p_dtypes.set_defaults(func=print_dtypes)

    p_calibrate = sub.add_parser(
        "calibrate",
        help="measure K/V ranges through vLLM and write the int8_static calibration file",
        usage="int8kv calibrate MODEL [options] [-- vLLM engine args]",
        description="Run MODEL through vLLM (GPU) on calibration text, record per-layer, "
        "per-kv-head K/V statistics as they enter the cache, and write the calibration file "
        "that --kv-cache-dtype int8_static loads. Arguments after `--` go to vLLM's engine "
        "(e.g. -- --tensor-parallel-size 2 --max-model-len 4096).",
    )
    calibrate.add_arguments(p_calibrate)
    p_calibrate.set_defaults(func=_run_calibrate)

    p_run = sub.add_parser(
        "run",
        help="run a command with the shim active in it and in every Python process it starts",
        usage="int8kv run [--] COMMAND [ARGS ...]",
        description=f"Run COMMAND with {INT8KV_SHIM}=1 and the shim's sitecustomize first on "
        "PYTHONPATH, so every Python process of it imports the shim before vLLM (the user's "
        "PYTHONPATH and sitecustomize are kept). Everything after `run` (or after its `--`) is "
        "the command, untouched.",
    )
    p_run.add_argument("command_argv", nargs=argparse.REMAINDER, metavar="COMMAND")
    p_run.set_defaults(func=run_command)
    return parser


def _run_calibrate(args: argparse.Namespace) -> int:
    return calibrate.run(args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Our arguments; after ``--``, vLLM engine arguments (``int8kv calibrate`` only), or the
    command of ``int8kv run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["run"]:
        args = parser.parse_args(argv)
        if args.command_argv[:1] == ["--"]:
            args.command_argv = args.command_argv[1:]
        args.engine_args = []
        return args
    ours, engine = calibrate.split_engine_args(argv)
    args = parser.parse_args(ours)
    if engine and args.command != "calibrate":
        parser.error(f"arguments after `--` are only for `int8kv calibrate`: {' '.join(engine)}")
    args.engine_args = engine
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""``int8kv calibrate``: measure a model's K/V ranges through vLLM and write the ``int8_static`` file.

    int8kv calibrate MODEL [--out FILE] [--text FILE] [--num-tokens N] [--seq-len L]
                     [--v-format int8|e4m3] [--percentile P] [-- vLLM engine args]

The model runs offline in vLLM with the shim active and ``--kv-cache-dtype int8`` (dynamic scales,
no calibration needed), eager mode, prefix caching off, over the shipped calibration text
(``int8kv_shim/static/calibration_data/``) or the ``--text`` files. Every layer's K and V, after
RoPE, are recorded per (kv head, channel) as they enter the cache (:mod:`int8kv_shim.static.recorder`), in
every worker process; the per-rank results come back through ``LLM.collective_rpc`` and are merged
into one file holding all kv heads (:mod:`int8kv_shim.static.file`), so it serves any TP size.

Everything but :func:`run` is pure and tested on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from int8kv_shim.static import file as scales_file

DEFAULT_NUM_TOKENS = 32768
DEFAULT_SEQ_LEN = 2048
MIN_SEQ_TOKENS = 16  # a shorter tail window is dropped rather than run
BATCH_SEQUENCES = 16  # sequences per LLM.generate call (one progress-bar step)
WORKER_EXTENSION = "int8kv_shim.static.recorder.CalibrationWorkerExtension"
CALIBRATION_KV_DTYPE = "int8"


def default_texts() -> list[Path]:
    """The calibration text shipped in the package, one document per file."""
    folder = resources.files("int8kv_shim.static") / "calibration_data"
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".txt"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hugging Face id, as for `vllm serve`")
    parser.add_argument(
        "--out",
        help=f"file to write (default: MODEL/{scales_file.DEFAULT_FILENAME}, where "
        "`--kv-cache-dtype int8_static` finds it; required when MODEL is not a local folder)",
    )
    parser.add_argument(
        "--text",
        action="append",
        metavar="FILE",
        help="calibration text file (repeatable); default: the text shipped with int8kv-shim "
        "(prose, code, dialogue)",
    )
    parser.add_argument(
        "--num-tokens",
        type=_positive_int,
        default=DEFAULT_NUM_TOKENS,
        help=f"tokens to run (default {DEFAULT_NUM_TOKENS}; fewer if the text is shorter)",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        default=DEFAULT_SEQ_LEN,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, at most the model's max length)",
    )
    parser.add_argument(
        "--v-format",
        choices=scales_file.V_FORMATS,
        default="int8",
        help="how V is stored: int8 (scale = stat/127) or FP8-E4M3 (scale = stat/448); "
        "K is always INT8",
    )
    parser.add_argument(
        "--percentile",
        type=_percentile,
        default=None,
        metavar="P",
        help="use the P-th percentile of |x| per (kv head, channel) (e.g. 99.9) instead of the "
        "absolute max",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _percentile(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100], not {value:g}")
    return value


def split_engine_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(ours, vLLM's)``: everything after the first ``--`` goes to vLLM's engine arguments."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def output_path(model: str, out: str | None) -> Path:
    if out:
        return Path(out).expanduser()
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise SystemExit(
            f"int8kv calibrate: {model} is not a local folder: pass --out FILE, and serve with "
            f"INT8KV_SCALES=FILE"
        )
    return folder / scales_file.DEFAULT_FILENAME


def calibration_overrides(engine_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The engine arguments a calibration run sets (from the user's ``engine_kwargs``), and notes
    about user values replaced.

    Every layer must run on our backend (to be recorded) with nothing served from a cache; the
    worker extension adds the RPC methods that arm and collect the recorders.
    """
    kwargs: dict[str, Any] = {}
    notes = []
    forced: dict[str, Any] = {
        "kv_cache_dtype": CALIBRATION_KV_DTYPE,
        "kv_cache_dtype_skip_layers": [],
        "enforce_eager": True,
        "enable_prefix_caching": False,
    }
    for key, value in forced.items():
        given = engine_kwargs.get(key)
        if given not in (None, value, [], False, "auto") and key != "enforce_eager":
            notes.append(f"ignoring {key}={given!r}: calibration runs with {key}={value!r}")
        kwargs[key] = value
    extension = engine_kwargs.get("worker_extension_cls") or ""
    if extension and extension != WORKER_EXTENSION:
        raise SystemExit(
            f"int8kv calibrate: --worker-extension-cls {extension} cannot be combined with "
            "calibration (it installs its own)"
        )
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs, notes


def plan_sequences(
    documents: Sequence[Sequence[int]], prefix: Sequence[int], seq_len: int, num_tokens: int
) -> list[list[int]]:
    """Token sequences to run: windows of each document (each after ``prefix``, e.g. BOS), taken
    round-robin across documents so that any budget mixes them, until ``num_tokens`` in all."""
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room after a {len(prefix)}-token prefix")
    queues = [_windows(doc, body) for doc in documents]
    out: list[list[int]] = []
    total = 0
    while queues:
        for queue in list(queues):
            window = next(queue, None)
            if window is None:
                queues.remove(queue)
                continue
            seq = [*prefix, *window][: num_tokens - total]
            if len(seq) - len(prefix) < MIN_SEQ_TOKENS and out:
                return out  # the budget's tail is too short to be worth a sequence
            out.append(seq)
            total += len(seq)
            if total >= num_tokens:
                return out
    return out


def _windows(doc: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(doc), size):
        window = list(doc[start : start + size])
        if len(window) >= MIN_SEQ_TOKENS or start == 0:
            yield window


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --------------------------------------------------------------------------------------------------
# The GPU part


def _engine_args(model: str, engine_argv: Sequence[str]) -> Any:
    """vLLM's ``EngineArgs`` from the arguments after ``--`` (as `vllm serve` takes them), with
    the calibration settings applied."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="int8kv calibrate -- "))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *engine_argv]))
    current = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    changes, notes = calibration_overrides(current)
    for note in notes:
        print(f"int8kv calibrate: {note}", file=sys.stderr)
    for key, value in changes.items():
        setattr(engine_args, key, value)
    return engine_args


def run(args: argparse.Namespace) -> int:
    from int8kv_shim.environment_variables import INT8KV_CALIBRATE, INT8KV_SHIM

    percentile = None if args.percentile in (None, 100) else args.percentile
    statistic = scales_file.statistic_name(percentile)
    out = output_path(args.model, args.out)
    texts = [Path(t) for t in args.text] if args.text else default_texts()
    for text in texts:
        if not text.is_file():
            raise SystemExit(f"int8kv calibrate: no such text file: {text}")

    # Inherited by every process vLLM starts: the shim patches each, and the impl records.
    os.environ[INT8KV_SHIM] = "1"
    os.environ[INT8KV_CALIBRATE] = "histogram" if percentile is not None else "absmax"
    import int8kv_shim

    if int8kv_shim.instrument() != "active":
        raise SystemExit("int8kv calibrate: the shim cannot activate here (see `int8kv doctor`)")

    engine_args = _engine_args(args.model, args.engine_args)

    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from int8kv_shim.static.recorder import merge_worker_stats

    llm = LLM.from_engine_args(engine_args)
    model_config = llm.model_config
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode("", add_special_tokens=True)  # BOS where the model uses one
    documents = [
        tokenizer.encode(t.read_text(encoding="utf-8"), add_special_tokens=False) for t in texts
    ]
    seq_len = min(args.seq_len, model_config.max_model_len)
    sequences = plan_sequences(documents, prefix, seq_len, args.num_tokens)
    planned = sum(map(len, sequences))
    if planned < args.num_tokens:
        print(
            f"int8kv calibrate: the text gives {planned} tokens, fewer than --num-tokens "
            f"{args.num_tokens}; using them all",
            file=sys.stderr,
        )

    llm.collective_rpc("int8kv_calibration_start")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with tqdm(total=planned, unit="tok", desc="int8kv calibrate", dynamic_ncols=True) as bar:
        for batch in batches(sequences, BATCH_SEQUENCES):
            llm.generate([{"prompt_token_ids": s} for s in batch], params, use_tqdm=False)
            bar.update(sum(map(len, batch)))
    results = llm.collective_rpc("int8kv_calibration_collect", args=(percentile,))

    num_layers = model_config.get_total_num_hidden_layers()
    num_kv_heads = model_config.get_total_num_kv_heads()
    stats, tokens = merge_worker_stats(results, num_kv_heads, num_layers)
    scales = scales_file.build(
        model=str(args.model),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=model_config.get_head_size(),
        v_format=args.v_format,
        statistic=statistic,
        num_tokens=tokens,
        stats=stats,
    )
    scales_file.write(out, scales)
    print(describe(scales, out))
    return 0


def describe(scales: scales_file.ScalesFile, path: Path) -> str:
    k = [x for layer in scales.layers.values() for head in layer.k_stat for x in head]
    v = [x for layer in scales.layers.values() for head in layer.v_stat for x in head]
    return (
        f"wrote {path}: {scales.num_layers} layers x {scales.num_kv_heads} kv heads x "
        f"{scales.head_dim} channels, "
        f"{scales.statistic} over {scales.num_tokens} tokens, v_format {scales.v_format}; "
        f"|K| {min(k):.3g}..{max(k):.3g}, |V| {min(v):.3g}..{max(v):.3g}\n"
        f"serve with: INT8KV_SHIM=1 "
        + ("" if _next_to_model(path, scales.model) else f"INT8KV_SCALES={path} ")
        + f"vllm serve {scales.model} --kv-cache-dtype int8_static"
    )


def _next_to_model(path: Path, model: str) -> bool:
    default = Path(model).expanduser() / scales_file.DEFAULT_FILENAME
    return path.expanduser().resolve() == default.resolve()

"""Which GPU architectures a CUDA library carries machine code (SASS) and PTX for.

A GPU runs a kernel from SASS built for its own architecture family, or else has the driver
compile the kernel's PTX first, on first use, into its compute cache (``~/.nv/ComputeCache``).
vLLM 0.24.0's FlashAttention-2 (``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``) is the baseline of
every speed comparison here, and on the H200 that stands in for Ampere its first engine start on
a host spends minutes capturing its first CUDA graph; this script reads the library's fatbins
(the ``.nv_fatbin`` payload: an 0xBA55ED50 header, then entries of kind PTX or ELF, each naming
its ``sm_XX``) and says which architectures it was built for, without a GPU.

    python -m benchmarks.cuda_archs --out benchmarks/results/fa2_cuda_archs.json
    python -m benchmarks.cuda_archs path/to/lib.so ...
"""

from __future__ import annotations

import argparse
import importlib.util
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import common
from int8kv_shim.package import installed_vllm_version

FATBIN_MAGIC = 0xBA55ED50
_MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
_ENTRY = struct.Struct("<HHIQ")  # kind, unknown, entry header size, payload size
_ENTRY_ARCH_OFFSET = 28  # the sm number, after sizes and the PTX/ELF version
KINDS = {1: "ptx", 2: "sass"}


def fatbin_entries(blob: bytes) -> Counter[tuple[str, int]]:
    """(kind, sm) -> count over every fatbin in ``blob``: ``("sass", 80)`` is machine code for
    sm_80, ``("ptx", 80)`` PTX a newer GPU's driver can compile."""
    found: Counter[tuple[str, int]] = Counter()
    start = blob.find(_MAGIC_BYTES)
    while start != -1:
        if start + _HEADER.size <= len(blob):
            _, _, header_size, size = _HEADER.unpack_from(blob, start)
            pos, end = start + header_size, min(start + header_size + size, len(blob))
            while pos + _ENTRY_ARCH_OFFSET + 4 <= end:
                kind, _, entry_header, payload = _ENTRY.unpack_from(blob, pos)
                if entry_header == 0:
                    break
                (arch,) = struct.unpack_from("<I", blob, pos + _ENTRY_ARCH_OFFSET)
                found[KINDS.get(kind, f"kind {kind}"), arch] += 1
                pos += entry_header + payload
        start = blob.find(_MAGIC_BYTES, start + 4)
    return found


def default_library() -> Path:
    """vLLM's FlashAttention-2 library, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed: pass the library's path")
    return (
        Path(list(spec.submodule_search_locations)[0]) / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so"
    )


def library_row(path: Path) -> dict[str, Any]:
    entries = fatbin_entries(path.read_bytes())
    return {
        "library": path.name,
        "bytes": path.stat().st_size,
        "sass_archs": sorted({sm for kind, sm in entries if kind == "sass"}),
        "ptx_archs": sorted({sm for kind, sm in entries if kind == "ptx"}),
        "entries": [{"kind": k, "sm": sm, "count": n} for (k, sm), n in sorted(entries.items())],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libraries", nargs="*", type=Path, help="default: vLLM's FlashAttention-2")
    p.add_argument("--out", type=Path, help="write the rows as a results JSON here")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    rows = [library_row(path) for path in (args.libraries or [default_library()])]
    for r in rows:
        print(f"{r['library']}: SASS for sm {r['sass_archs']}, PTX for sm {r['ptx_archs']}")
    if args.out:
        doc = {
            "gpu": "none (reads the library file)",
            "command": " ".join(["python -m benchmarks.cuda_archs", *argv]),
            "vllm": installed_vllm_version(),
            "rows": rows,
        }
        common.write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Re-create ``pride_and_prejudice.txt`` from Debian's ``r-cran-janeaustenr`` package.

Reproduces the shipped corpus byte for byte, without R:

    apt-get download r-cran-janeaustenr          # 1.0.0-1, Debian 12 (bookworm) main
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb deb
    python3 benchmarks/corpus/extract_janeaustenr.py \
        deb/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb benchmarks/corpus/pride_and_prejudice.txt

The package keeps its six novels in an R lazy-load database (``Rdata.rdb``): back-to-back records of
a 4-byte big-endian length and a zlib stream holding one R object serialized in XDR format. Each
novel is a character vector, one element per line of the Project Gutenberg text. The records are
stored in the alphabetical order of the object names (emma, mansfieldpark, northangerabbey,
persuasion, prideprejudice, sensesensibility); we pick the one whose first line is the title rather
than trusting the order.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from collections.abc import Iterator

EXPECTED_SHA256 = "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d"
TITLE = "PRIDE AND PREJUDICE"

# R SEXP type codes that occur in these records (R Internals, "Serialization Formats").
_CHARSXP, _STRSXP, _NILVALUE = 9, 16, 254


def _records(blob: bytes) -> Iterator[bytes]:
    """Yield the decompressed payload of every record of a lazy-load ``.rdb`` file."""
    off = 0
    while off < len(blob):
        (size,) = struct.unpack(">I", blob[off : off + 4])
        dec = zlib.decompressobj()
        payload = dec.decompress(blob[off + 4 :])
        if len(payload) != size:
            raise ValueError(f"record at {off}: {len(payload)} bytes, header says {size}")
        off = len(blob) - len(dec.unused_data)
        yield payload


def _read_character_vector(payload: bytes) -> list[str] | None:
    """Decode ``payload`` if it is a serialized character vector (attributes ignored), else None."""
    if payload[:2] != b"X\n":
        raise ValueError("not an XDR-serialized R object")
    pos = 2

    def int32() -> int:
        nonlocal pos
        (v,) = struct.unpack(">i", payload[pos : pos + 4])
        pos += 4
        return v

    version = int32()
    int32()  # writer R version
    int32()  # minimal reader R version
    if version == 3:
        n_enc = int32()  # native encoding name; read before `pos +=`, which int32() moves
        pos += n_enc
    flags = int32()
    if flags & 0xFF != _STRSXP:
        return None
    out: list[str] = []
    for _ in range(int32()):
        elt_flags = int32()
        if elt_flags & 0xFF != _CHARSXP:
            raise ValueError(f"unexpected element type {elt_flags & 0xFF}")
        n = int32()
        if n == -1:  # NA_character_
            out.append("")
            continue
        out.append(payload[pos : pos + n].decode("utf-8"))
        pos += n
    return out


def extract(rdb_path: str, title: str = TITLE) -> str:
    """Return the novel whose first line is ``title``, lines joined with ``\\n``."""
    with open(rdb_path, "rb") as f:
        blob = f.read()
    for payload in _records(blob):
        lines = _read_character_vector(payload)
        if lines and lines[0] == title:
            return "\n".join(lines) + "\n"
    raise LookupError(f"no character vector starting with {title!r} in {rdb_path}")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    text = extract(argv[1])
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    with open(argv[2], "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    status = "matches" if digest == EXPECTED_SHA256 else "DIFFERS FROM"
    print(f"{argv[2]}: {len(text)} chars, sha256 {digest} ({status} the shipped corpus)")
    return 0 if digest == EXPECTED_SHA256 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

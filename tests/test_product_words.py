"""The product speaks of the project alone: measurements are named by date, commit and content.

Run and tracker numbers mean nothing to a user and go stale; they stay out of every tracked text
file and every tracked path (git history keeps whatever named them before).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# A run or tracker number: "session" or "issue", an optional space, a digit.
NUMBERED = r"(session|issue) ?[0-9]"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def checkout() -> Path:
    # An sdist or a copied tree has no tracked files to speak of: nothing to check there.
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO.resolve():
        pytest.skip(f"{REPO} is not the top of a git checkout")
    return REPO


def test_tracked_text_names_no_run_or_issue_numbers(checkout: Path) -> None:
    # -I: binary files (plots) are not text; exit status 1 means no match
    found = _git("grep", "-n", "-I", "-i", "-E", NUMBERED)
    assert found.returncode in (0, 1), found.stderr
    assert found.stdout == "", "name these by date, git commit or content:\n" + found.stdout


def test_tracked_paths_name_no_run_or_issue_numbers(checkout: Path) -> None:
    paths = _git("ls-files").stdout.splitlines()
    numbered = [p for p in paths if _numbered(p)]
    assert not numbered, "rename by date or content: " + ", ".join(numbered)


def _numbered(path: str) -> bool:
    return re.search(NUMBERED, path, flags=re.IGNORECASE) is not None


def test_the_pattern_catches_what_it_is_for() -> None:
    # a check that cannot fail checks nothing: these must be caught, these not (the caught ones
    # are built here so that this file passes its own check)
    assert _numbered("benchmarks/results/logs/" + "session" + "14/x.log")
    assert _numbered("Issue" + " 3's targets") and _numbered("SESSION" + " 9")
    assert not _numbered("decode_issue_budget.json") and not _numbered("issue slots at 4 warps")

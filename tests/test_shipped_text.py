"""Text a user reads speaks to users: no internal bookkeeping in the repository's shipped text.

Session numbers ("stop 51"), lettered machines ("CPU A") and internal issue numbers ("issue 19") mean nothing to a
user. Hardware is named by what it is, a result by its version or commit and the command that reproduces it. Checked
over every text file the project ships or documents: README, docs, the package, the JSON Schema, scripts,
benchmarks, deploy files, model YAMLs, and the tests themselves.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("README.md", "docs", "handlers", "schema", "scripts", "benchmarks", "deploy", "model_configs", "tests",
           "mkdocs.yml", "pyproject.toml", "constraints")
SUFFIXES = {".md", ".py", ".json", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cpp", ".properties", ""}
BOOKKEEPING = re.compile(r"\b(?:[Ss]tops? [0-9]+|[Ii]ssues? [0-9]+|CPU [A-E]\b)")


def shipped_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *CHECKED], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in tracked if Path(name).suffix in SUFFIXES and (REPO / name).is_file()]


def test_no_internal_bookkeeping_in_shipped_text():
    this = Path(__file__).resolve()
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
             for path in shipped_files() if path.resolve() != this
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if BOOKKEEPING.search(line)]
    assert not found, "internal bookkeeping in text users read:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    assert BOOKKEEPING.search("measured at stop 73") and BOOKKEEPING.search("on CPU A (an AMD EPYC)")
    assert BOOKKEEPING.search("Issue 19's goals") and not BOOKKEEPING.search("a CPU A4 flag, 2 stops")
    assert len(shipped_files()) > 100

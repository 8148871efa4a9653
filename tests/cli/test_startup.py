"""`attnflow --help` starts without the heavy libraries: torch, transformers, scipy and numba load
only when a command needs them (benchmarks/HISTORY.md, "Start-up")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "scipy", "numba", "matplotlib")

# Runs the command in a fresh interpreter and prints which heavy top-level modules it imported.
PROBE = """
import json, sys
from attnflow.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules} & set(%r))), file=sys.stderr)
"""


def imported_by(*argv: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ("--help",),
        ("explain", "--help"),
        ("evaluate", "--help"),
        ("explore", "--help"),
        ("corpus", "--help"),
        ("audit", "--help"),
        ("routes", "--help"),
    ],
)
def test_help_imports_no_heavy_library(argv):
    assert imported_by(*argv) == []


def test_the_probe_sees_heavy_imports():
    """The oracle can fail: the model code imports torch."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, attnflow.capture.model; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "True"


def test_import_attnflow_and_its_methods_stays_light():
    code = (
        "import sys, attnflow; attnflow.available_methods(); "
        f"print(sorted({{n.partition('.')[0] for n in sys.modules}} & set({HEAVY!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"

"""Runs a test module's Triton cases in a child process under ``TRITON_INTERPRET=1``.

The interpreter has to be switched on before Triton is imported, and the test process
may already hold a compiled-mode Triton, so each kernel test file runs itself as a
script in a child (its ``__main__`` prints one JSON line of per-case results) and its
tests read those results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout_s: float = 300) -> dict[str, dict]:
    """``{case_name: result}`` from running ``script`` under the Triton interpreter.

    Raises:
        pytest.fail.Exception: the child exited non-zero (its stderr's end is shown).
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT, check=False)
    if proc.returncode != 0:
        pytest.fail(f"interpreter child process failed:\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

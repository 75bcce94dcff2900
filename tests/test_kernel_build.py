"""The C++ kernels' build is keyed so that checkouts share it and environments do not.

Issue 23: two checkouts with two virtual environments on one machine rebuilt each
other's kernels forever, because the key held only the source and the CPU flags while
torch writes each environment's include and library paths into the build. The key now
holds the csrc files, the CPU flags, ``sys.prefix`` and torch's version
(``triton_kernels.cpu_ops._build_key``).

These tests never compile: they run against the build that ``make test``'s set-up made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from triton_kernels import cpu_ops

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import sys, triton_kernels.cpu_ops as c; "
         "assert c.__file__.startswith(sys.argv[1]), c.__file__; "
         "print(c._build_key(), sys.prefix)")


def _checkout(tmp_path: Path, name: str) -> Path:
    """A second checkout of the kernels package (its files, another path)."""
    clone = tmp_path / name
    shutil.copytree(REPO_ROOT / "triton_kernels", clone / "triton_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def _run(python: str, clone: Path, code: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(clone)}
    result = subprocess.run([python, "-c", code, str(clone)], env=env, capture_output=True,
                            text=True, timeout=timeout, cwd=clone)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def built_so() -> Path:
    if cpu_ops.load() is None:
        pytest.skip("the C++ kernels are not built here (no compiler)")
    return Path(cpu_ops.load().__file__)


def test_a_second_checkout_in_the_same_environment_reuses_the_build(tmp_path, built_so):
    clone = _checkout(tmp_path, "clone")
    key, _ = _run(sys.executable, clone, PROBE).split()
    assert key == cpu_ops._build_key()
    before = built_so.stat().st_mtime_ns
    load = ("import sys, triton_kernels.cpu_ops as c; m = c.load(); "
            "assert c.__file__.startswith(sys.argv[1]); print(m.__file__)")
    assert _run(sys.executable, clone, load).strip() == str(built_so)
    assert built_so.stat().st_mtime_ns == before, "the second checkout rebuilt the kernels"


def test_two_checkouts_starting_at_once_build_nothing(tmp_path, built_so):
    clones = [_checkout(tmp_path, f"clone{i}") for i in range(2)]
    before = built_so.stat().st_mtime_ns
    load = ("import sys, triton_kernels.cpu_ops as c; m = c.load(); "
            "assert c.__file__.startswith(sys.argv[1]); print(m.__file__)")
    procs = [subprocess.Popen([sys.executable, "-c", load, str(c)], cwd=c, text=True,
                              env={**os.environ, "PYTHONPATH": str(c)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for c in clones]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(built_so)}
    assert built_so.stat().st_mtime_ns == before


def test_another_environment_gets_its_own_stable_key(tmp_path):
    # A second venv that sees this one's packages through a .pth file: same sources,
    # same CPU, same torch, another sys.prefix.
    venv = tmp_path / "venv2"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})
                   ["purelib"])
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = str(venv / "bin" / "python")
    clone = _checkout(tmp_path, "clone")
    first = _run(python, clone, PROBE).split()
    again = _run(python, clone, PROBE).split()
    assert Path(first[1]).resolve() == venv.resolve()
    assert first[0] != cpu_ops._build_key(), "two environments would share one build"
    assert again == first, "the key of one environment must not change between starts"

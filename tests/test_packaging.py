"""A wheel-style ``pip install .`` carries everything the package needs at run
time: every Python package of the tree (pyproject lists them by hand, since the
chat page maps ``web/`` to ``aioengine/web``), the chat page and the C++ kernel
sources; and the installed server finds its chat page there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist",
                                ".pytest_cache", ".ruff_cache", ".hypothesis", "tests", "bench")


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory) -> tuple[zipfile.ZipFile, str]:
    """The wheel, and the build's output (``pip -v``: setuptools' own warnings)."""
    # Built from a copy: setuptools writes build/ and *.egg-info next to pyproject.toml.
    src = tmp_path_factory.mktemp("src") / "aioengine"
    shutil.copytree(REPO_ROOT, src, ignore=IGNORE)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-v", str(src), "-w", str(out)],
                           check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("aioengine-*.whl")
    return zipfile.ZipFile(path), build.stdout + build.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build) -> zipfile.ZipFile:
    return wheel_build[0]


def test_the_build_warns_about_no_package(wheel_build):
    """setuptools once printed ~40 lines of "Package 'aioengine.web.vendor' is absent
    from the `packages` configuration" (web/vendor/ given as data of aioengine.web)."""
    log = wheel_build[1]
    assert "BuildBackendWarning" not in log and "is absent from the" not in log, log[-3000:]


def test_the_wheel_holds_every_package(wheel):
    names = set(wheel.namelist())
    for top in ("aioengine", "triton_kernels"):
        for init in (REPO_ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(REPO_ROOT).as_posix()
            assert rel in names, f"{rel} is missing: add its package to pyproject.toml"


def test_the_wheel_holds_the_chat_page_and_the_kernel_sources(wheel):
    names = set(wheel.namelist())
    for page in (REPO_ROOT / "web").rglob("*"):
        if page.is_file():
            rel = f"aioengine/web/{page.relative_to(REPO_ROOT / 'web').as_posix()}"
            assert rel in names, rel
    for source in (REPO_ROOT / "triton_kernels" / "csrc").iterdir():
        if source.suffix in (".cpp", ".h"):
            assert f"triton_kernels/csrc/{source.name}" in names, source.name


def test_an_installed_server_serves_its_chat_page(wheel, tmp_path):
    """Installed into a bare target (no repository around it), server.py's
    default web folder is the package's copy."""
    wheel.extractall(tmp_path)
    code = ("from aioengine.entrypoints import server; "
            "print(server.DEFAULT_WEB_DIR, (server.DEFAULT_WEB_DIR / 'index.html').is_file())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(tmp_path),
                                                     "PATH": "/usr/bin:/bin"})
    web_dir, found = out.stdout.split()
    assert Path(web_dir) == tmp_path / "aioengine" / "web" and found == "True", out.stdout

"""The install lines a user pastes or ``make`` runs take torch's CPU build, never a CUDA one:
pip's default index (PyPI) serves a CUDA build of torch on Linux, several GB."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _makefile_torch() -> list[str]:
    """The Makefile's ``TORCH`` arguments to ``pip install``."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    line = re.search(r"^TORCH :?= (.*)$", text, flags=re.M)
    assert line, "the Makefile sets TORCH"
    return shlex.split(line.group(1))


def test_every_pasted_torch_install_names_the_cpu_index():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    found = 0
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            if re.match(r"\s*pip install .*\btorch\b", line):
                found += 1
                assert f"--index-url {CPU_INDEX}" in line, (page.name, line)
    assert found >= 2  # the README's and the docs' home page's
    spec = _makefile_torch()
    assert re.fullmatch(r"torch==[\d.]+\+cpu", spec[0]), spec  # a version PyPI does not have
    assert spec[spec.index("--extra-index-url") + 1] == CPU_INDEX


def test_pip_resolves_the_makefiles_torch_to_the_cpu_build():
    """pip's own resolution (``--dry-run --report``) of the Makefile's torch, with nothing
    installed: a ``+cpu`` wheel from PyTorch's CPU index, or a local copy of it where that
    index is out of reach. Skipped only where pip reaches no index at all."""
    try:
        report = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
             "--no-deps", "--ignore-installed", *_makefile_torch()],
            capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("pip reached no index within 300 s")
    unreachable = ("NameResolutionError", "Failed to establish a new connection",
                   "Network is unreachable", "Temporary failure in name resolution")
    if report.returncode != 0:
        if any(reason in report.stderr for reason in unreachable) and \
                "No matching distribution" not in report.stderr:
            pytest.skip(f"pip could not reach an index: {report.stderr.strip()[-200:]}")
        pytest.fail(f"pip cannot resolve the Makefile's torch: {report.stderr.strip()[-500:]}")
    installs = json.loads(report.stdout)["install"]
    assert [i["metadata"]["name"] for i in installs] == ["torch"]
    assert installs[0]["metadata"]["version"].endswith("+cpu"), installs[0]["download_info"]
    url = installs[0]["download_info"]["url"]
    assert url.startswith((CPU_INDEX.rsplit("/whl", 1)[0], "file:")), url

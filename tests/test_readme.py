"""The README's quick start, run as a user pastes it: SFI text with fast steps, from Python,
inside ``model.generate`` and from the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks(kind: str) -> list[str]:
    """The README's code blocks of one kind (``python``, ``bash``) in the quick start."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Quick start")
    section = readme[start:readme.index("\n## ", start + 1)]
    return re.findall(rf"```{kind}\n(.*?)```", section, flags=re.S)


@pytest.mark.model
def test_the_python_quick_starts_print_sfi_text_with_fast_steps(default_model, tmp_path):
    python = _blocks("python")
    script = python[0] + "\n" + python[1]  # the second continues the first's variables
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = re.search(r"SFI: (\d+) fast and (\d+) slow steps", result.stdout)
    assert summary and int(summary.group(1)) > 0, result.stdout
    stats = re.search(r"'fast_steps': (\d+)", result.stdout)
    assert stats and int(stats.group(1)) > 0, result.stdout
    text = result.stdout[:summary.start()].strip()
    assert len(text.split()) >= 5  # the answer itself, not an empty string


@pytest.mark.model
def test_the_command_line_quick_start_prints_sfi_text_with_fast_steps(default_model, tmp_path):
    lines = _blocks("bash")[0].replace("\\\n", "").splitlines()
    commands = [line for line in lines if "essay" in line]  # the file, then sfi generate on it
    assert len(commands) == 2 and commands[1].startswith("sfi generate")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-ec", "\n".join(commands)], capture_output=True, text=True,
                            timeout=900, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    fast = re.search(r"fast (\d+) / dense", " ".join(result.stderr.split()))
    assert fast and int(fast.group(1)) > 0, result.stderr[-2000:]
    assert len(result.stdout.split()) >= 5

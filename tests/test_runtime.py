"""Process-wide settings of sfi's commands (sfi.runtime)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHECK = "from sfi.runtime import keep_freed_memory; print(keep_freed_memory())"


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_keep_freed_memory_takes_effect_and_can_be_switched_off():
    def run(value: str) -> str:
        env = {"SFI_KEEP_FREED_MEMORY": value, "PATH": ""}
        return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                              env=env, check=True).stdout.strip()

    assert run("1") == "True"
    assert run("0") == "False"

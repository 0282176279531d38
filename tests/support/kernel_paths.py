"""Running a kernel check in a fresh interpreter with some of the native
library's CPU paths turned off (the ``NUMA_ENGRAM_NO_*`` switches are read
once, when the library loads, so each set of them needs its own process)."""

import os
import subprocess
import sys
import textwrap


def assert_prints_true(code: str, disabled: tuple[str, ...]) -> None:
    """Run ``code`` (indented source, dedented here) with each variable in
    ``disabled`` set to 1: it must exit 0 and print exactly ``True``."""
    env = dict(os.environ, **{name: "1" for name in disabled})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"

"""The server starts without scipy: only a rollout report imports it."""

from __future__ import annotations

import subprocess
import sys


def test_serving_code_does_not_import_scipy():
    code = (
        "import sys\n"
        "import bitserve.cli, bitserve.server.app, bitserve.rollout.state\n"
        "import bitserve.rollout.verdict, bitserve.rollout.command\n"
        "assert 'scipy' not in sys.modules, 'scipy imported at start-up'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

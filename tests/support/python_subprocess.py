"""Run a snippet in a fresh Python interpreter: for what one process can check only once (which
modules an import pulls in, running with a package made unimportable).

    run_python("import sys, fcp; print('fla' in sys.modules)")   # -> "False\n"
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120) -> str:
    """The standard output of ``python -c code`` run in the repository root (this
    interpreter); raises ``subprocess.CalledProcessError`` when it fails."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, check=True)  # fmt: skip
    return out.stdout

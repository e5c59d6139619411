"""tools/fuzz_core.py, the bindings' fuzzer (``make sanitize`` runs it longer under ASan + UBSan), for a few
hundred iterations on the normal build: every hostile call is refused or answered as its contract says. In a
subprocess: on a regression the call may corrupt memory instead of raising."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge import _native

pytestmark = pytest.mark.skipif(not _native.available("DecodeModel"), reason="C++ extension not built")
FUZZER = Path(__file__).resolve().parents[2] / "tools" / "fuzz_core.py"


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bindings_fuzzer_finds_nothing(seed: int) -> None:
    out = subprocess.run([sys.executable, str(FUZZER), "--iterations", "400", "--seed", str(seed)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "all answers as their contracts say" in out.stdout

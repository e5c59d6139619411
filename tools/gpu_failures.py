"""A pytest plugin for the GPU check (``-p gpu_failures``): each failure named on its own line the moment it
happens, so a test run cut short by its stage's time cap still says which tests failed (pytest's own summary
comes only at the end; a GPU run of 2026-11-27 was cut after one ``F`` and never said which)."""

from __future__ import annotations

import sys
from typing import Any

PREFIX = "GPU-CHECK FAILED "


def pytest_runtest_logreport(report: Any) -> None:
    """One line per failed setup, call or teardown: the prefix, the test id, the phase and the error."""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the error's own message, else the report's last line
        lines = str(report.longrepr).strip().splitlines() if report.longrepr else [""]
        message = " ".join((crash.message if crash is not None else lines[-1]).split())
        sys.stdout.write(f"\n{PREFIX}{report.nodeid} ({report.when}): {message[:300]}\n")
        sys.stdout.flush()

"""Loaded by every Python process that tools/sanitize.sh starts (this folder is first on its PYTHONPATH): when
LMFORGE_SANITIZED_CORE names the ASan + UBSan build of the extension, importing ``lmforge._core`` loads that file
instead of the installed one, in the test process and in the subprocesses and forks the tests start. Nothing is
imported until something asks for ``lmforge._core``."""

import importlib.machinery
import importlib.util
import os
import sys


class _SanitizedCore:
    """A meta path finder that answers ``lmforge._core`` with the sanitized build."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "lmforge._core":
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


if os.environ.get("LMFORGE_SANITIZED_CORE"):
    sys.meta_path.insert(0, _SanitizedCore(os.environ["LMFORGE_SANITIZED_CORE"]))

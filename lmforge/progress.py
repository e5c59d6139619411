"""Progress reporting that reads well in a terminal and in a log file.

:func:`progress` is the one place that decides how long-running work shows its progress: a tqdm bar when
stderr is a terminal, otherwise (stderr redirected, or ``TQDM_DISABLE=1``) a plain ``lmforge`` log line every
few seconds with the same figures, so a log file never holds a ``\\r``. ``enabled=False``, or the
``lmforge`` logger set above INFO (the CLI's ``--quiet``), shows nothing. Both kinds have the interface the
callers use: ``update``, ``set_postfix``, ``set_postfix_str``, ``close``, ``n``, ``total``, and ``with``.

``LMFORGE_PROGRESS_SECONDS`` sets the seconds between plain lines (default 10).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import functools
from typing import Any, Callable

from lmforge.common import human_bytes

logger = logging.getLogger("lmforge")

__all__ = ["progress", "LineProgress"]

DEFAULT_SECONDS = 10.0


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _seconds() -> float:
    value = os.environ.get("LMFORGE_PROGRESS_SECONDS")
    if not value:
        return DEFAULT_SECONDS
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"LMFORGE_PROGRESS_SECONDS={value!r} is not a number of seconds; set it to e.g. 10 "
                         "or unset it") from None


def progress(total: float | None, desc: str, unit: str = "it", enabled: bool = True, *, initial: float = 0,
             leave: bool = True) -> Any:
    """A progress reporter for ``total`` units (None: unknown) of ``unit`` (``"B"`` is shown as bytes).

    On a terminal (stderr is a TTY, or in a Jupyter kernel: tqdm's widget) with ``TQDM_DISABLE`` unset: a tqdm
    bar, with ``lmforge`` log lines printed above it rather than through it. Otherwise: a :class:`LineProgress`
    logging one plain line every ``LMFORGE_PROGRESS_SECONDS``. ``enabled=False``, or the ``lmforge`` logger's
    own level set above INFO (``--quiet``): a reporter that shows nothing.
    """
    enabled = enabled and logger.level <= logging.INFO  # NOTSET (a library caller's default) shows progress
    if enabled and not _env_true("TQDM_DISABLE") and (sys.stderr.isatty() or "ipykernel" in sys.modules):
        return _bar_class()(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit == "B", leave=leave,
                    dynamic_ncols=True)
    return LineProgress(total, desc, unit, enabled=enabled, initial=initial, every=_seconds())


@functools.cache
def _bar_class() -> type:
    """The tqdm bar class, built on first use: tqdm (and the asyncio it pulls in) costs ~20 ms to import, which
    a command run with its output redirected, or with ``--quiet``, never needs."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    class _Bar(tqdm):
        """A tqdm bar that routes the ``lmforge`` logger's console lines above itself while it is open."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._redirect = contextlib.ExitStack()
            if any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
                self._redirect.enter_context(logging_redirect_tqdm([logger]))

        def close(self) -> None:
            super().close()
            redirect = getattr(self, "_redirect", None)  # tqdm may call close() from __del__ after a failed __init__
            if redirect is not None:
                redirect.close()

    return _Bar


class LineProgress:
    """Plain progress lines on the ``lmforge`` logger: the first update, then one every ``every`` seconds, and
    a last line on ``close``.

    A line reads e.g. ``train: 40/100 step (40%), 2.10 step/s, eta 0:00:28, loss=3.2100, lr=1.00e-03``.
    ``clock`` is injectable for tests.
    """

    def __init__(self, total: float | None, desc: str, unit: str = "it", *, enabled: bool = True,
                 initial: float = 0, every: float = DEFAULT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.disable = not enabled
        self.every, self._clock = every, clock
        self._start_n, self._start = initial, clock()
        self._last_line: float | None = None
        self._postfix = ""
        self._unlogged = False  # figures changed since the last line
        self._closed = False

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        self._unlogged = True
        if self.disable:
            return
        now = self._clock()
        if self._last_line is None or now - self._last_line >= self.every:
            self._emit(now)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())
        self._unlogged = True

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = s
        self._unlogged = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.disable and self._unlogged and self.n != self._start_n:
            self._emit(self._clock())

    def line(self, now: float) -> str:
        """The text of one progress line at time ``now``."""
        def amount(x: float) -> str:
            return human_bytes(x) if self.unit == "B" else f"{x:,.0f}"

        done = amount(self.n) if self.total is None else f"{amount(self.n)}/{amount(self.total)}"
        parts = [f"{self.desc}: {done}" + ("" if self.unit == "B" else f" {self.unit}")]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else None
        if rate:
            parts.append(f"{human_bytes(rate)}/s" if self.unit == "B" else f"{rate:.3g} {self.unit}/s")
            if self.total is not None and self.total > self.n:
                import datetime  # here: most runs never draw an ETA

                parts.append(f"eta {datetime.timedelta(seconds=round((self.total - self.n) / rate))}")
        if self._postfix:
            parts.append(self._postfix)
        return ", ".join(parts)

    def _emit(self, now: float) -> None:
        logger.info("%s", self.line(now))
        self._last_line, self._unlogged = now, False

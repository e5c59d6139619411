"""Confidence intervals for accuracies: the Wilson score interval (95% by default).

Wilson rather than the normal approximation ``p ± 1.96·sqrt(p(1-p)/n)``: it stays inside [0, 1] and is not
zero-width at 0% or 100%, which small eval sets of small models hit often.

>>> lo, hi = wilson_interval(8, 10)
>>> round(lo, 3), round(hi, 3)
(0.49, 0.943)
"""

from __future__ import annotations

import math

__all__ = ["Z95", "wilson_interval"]

Z95 = 1.959963984540054
"""The standard normal quantile of 0.975 (a two-sided 95% interval)."""


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of a proportion ``successes / n`` (``(0, 1)`` when ``n == 0``)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)

"""Sizes in units a person reads at a glance, shared by every message that names a byte count."""
from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human(n: float) -> str:
    """``4676`` -> ``4.6 KiB``; below 1 KiB the bytes themselves (``12 B``). Never rounds a non-zero size
    to zero: a message that says "needs 0.00 GiB" hides what is missing."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n} B"   # pragma: no cover


def size_and_bytes(n: int) -> str:
    """``4.6 KiB (4676 bytes)``: readable and exact, for messages comparing two sizes."""
    return f"{human(n)} ({n} bytes)" if n >= 1024 else f"{n} bytes"

"""Byte quantities: parsing capacities such as ``"24GiB"`` and formatting bytes in binary units.

Bytes stay integers everywhere in batchfit; only this module and the report layer turn them into text.
"""

from __future__ import annotations

import re

from .errors import ConfigError

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_CAPACITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def looks_like_capacity(text: str) -> bool:
    """True when ``text`` reads as a number with an optional byte unit (``"24GiB"``, ``"16 GB"``)."""
    m = _CAPACITY.match(text)
    return bool(m) and m.group(2).lower() in _UNITS


def parse_bytes(text: str | int) -> int:
    """Parse ``"24GiB"``, ``"16GB"``, ``"512MiB"`` or a plain integer into bytes.

    SI units (GB) are powers of 1000 and binary units (GiB) powers of 1024, as written on the box.

    Raises:
        ConfigError: the text is not a positive number with a known unit.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _CAPACITY.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"cannot read capacity {text!r}; write a number with a unit, e.g. '24GiB', '16GB' or '512MiB'"
            )
        value = int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))
    if value <= 0:
        raise ConfigError(f"capacity must be positive, got {text!r}; e.g. '24GiB'")
    return value


def format_bytes(n: int | float, precision: int = 2) -> str:
    """``1536 -> '1.50 KiB'``: binary units, since that is what allocators and nvidia-smi count in."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"

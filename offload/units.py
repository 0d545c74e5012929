"""Sizes and rates as users write them (22GiB, 25GB/s, 165TFLOPS) and as offload prints them."""

from __future__ import annotations

import math
import re

from offload.errors import ConfigError

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*"


def parse_size(value, what: str = "size") -> int:
    """Bytes from 22GiB, 64GB, 512MiB, 1.5TB or a plain number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 22GiB or 64GB, found {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{what}: expected a size of 0 or more, found {value!r}")
        return int(value)
    m = re.fullmatch(_NUMBER + r"([a-z]*)\s*", str(value).lower())
    if not m or m.group(2) not in _SIZE_UNITS:
        raise ConfigError(f"{what}: expected a size such as 22GiB, 64GB or 512MiB, found {value!r}")
    size = float(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if not math.isfinite(size):  # 1e999GiB: past what a float holds
        raise ConfigError(f"{what}: expected a size such as 22GiB, 64GB or 512MiB, found {value!r}, which is too "
                          f"large to be a number of bytes")
    return int(size)


def parse_rate(value, what: str = "rate") -> float:
    """Per-second figure from 25GB/s, 165TFLOPS, 1.2e12 or a plain number."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a number such as 25GB/s or 165TFLOPS, found {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{what}: expected a rate of 0 or more, found {value!r}")
        return float(value)
    m = re.fullmatch(_NUMBER + r"([kmgtp]?)(?:i?b/s|flops|flop/s)?\s*", str(value).lower())
    if not m:
        raise ConfigError(f"{what}: expected a rate such as 25GB/s or 165TFLOPS, found {value!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def format_bytes(n: float) -> str:
    """Human-readable binary size: 21.5 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"

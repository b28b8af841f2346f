"""Value types for ``argparse`` flags that every command line shares (engine, gateway, simulator,
benchmarks): each parses one flag value or raises ``argparse.ArgumentTypeError`` saying what it must be."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def at_least_one(text: str) -> float:
    """A finite number >= 1 (a ratio)."""
    value = float(text)
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def int_list_at_least(minimum: int) -> Callable[[str], list[int]]:
    """A type for comma-separated integers >= ``minimum`` (at least one)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return values

    return parse


int_list = int_list_at_least(1)
"""Comma-separated integers >= 1 (at least one)."""


def name_list(choices: Sequence[str], what: str, *, in_order: bool = False,
              allow_empty: bool = False) -> Callable[[str], list[str]]:
    """A type for comma-separated names out of ``choices`` (``what`` names them in the error, e.g.
    ``"system(s)"``): the names as given, or in the order of ``choices`` (``in_order``); an empty list
    only with ``allow_empty``."""

    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in names if s not in choices]
        if bad or not (names or allow_empty):
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {', '.join(choices)}")
        return [c for c in choices if c in names] if in_order else names

    return parse

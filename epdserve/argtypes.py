"""argparse value types shared by the sub-commands: each names the bad value."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting whole numbers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {minimum}")
        return value

    return parse

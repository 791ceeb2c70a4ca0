"""The one parser of positive integers written as text: URL versions, query counts, version
folder names, config values, command-line counts and header lengths all go through it.

``str.isdigit()`` is no test for "``int()`` will take this": it accepts ``'¹'``, which
``int()`` refuses (a 500 where a 400 belongs), and ``int()`` itself accepts ``'٣'``, ``'１'``,
``' 3'`` and ``'+3'``, so one version would have many spellings. Here only ASCII digits count.

Policy: ASCII digits ``0-9`` only, no sign, no spaces, no underscores; leading zeros are
accepted (``'007'`` is 7, as ``int()`` and every caller took it before); at most
``MAX_DIGITS`` digits, so every value fits a signed 64-bit integer (msgpack, numpy) and no
text reaches ``int()``'s own limit on long strings.
"""

from __future__ import annotations

import re

MAX_DIGITS = 18  # 10**18 - 1 < 2**63 - 1
_ASCII_DIGITS = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}")
ASCII_DIGITS_RULE = f"in ASCII digits 0-9 (at most {MAX_DIGITS})"
POSITIVE_INT_RULE = f"a positive integer {ASCII_DIGITS_RULE}"


def parse_positive_int(text: str, *, zero_allowed: bool = False) -> int | None:
    """``text`` as an integer >= 1 (>= 0 when ``zero_allowed``), or None when it is anything
    else (see the module doc); the caller raises its own error, naming what was wrong."""
    if _ASCII_DIGITS.fullmatch(text) is None:
        return None
    value = int(text)
    if value == 0 and not zero_allowed:
        return None
    return value

"""On/off switches read from the environment (``MULA_CHECKPOINT_DIRECT_IO=0``, ``MULA_DEBUG=1``, ...), one rule for all.

Why one rule: each switch used to parse its own value, so ``0`` turned one off, ``false`` another, and a typo such as
``MULA_CHECKPOINT_DIRECT_IO=fasle`` silently left the feature on. :func:`env_flag` takes the usual spellings and names
the variable and its value for anything else, as a bad configuration value would be.
"""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_OFF = frozenset({"0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: ``default`` when unset or empty; ``0`` / ``false`` / ``no`` / ``off`` turn it off, ``1`` /
    ``true`` / ``yes`` / ``on`` or another non-zero integer on (case and surrounding spaces ignored).

    Raises:
        ValueError: for any other value, naming the variable and the value.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _OFF:
        return False
    if value in _ON:
        return True
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a switch value: use 1 / 0, true / false, yes / no or on / off"
        ) from None

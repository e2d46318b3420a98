"""The integrations' logger ("tpfuse.integrations"; no handlers configured here) and `log_once`."""

from __future__ import annotations

import logging

logger = logging.getLogger("tpfuse.integrations")

_LOGGED: set = set()


def log_once(key: str, message: str, *, level: int = logging.INFO) -> bool:
    """Log `message` the first time `key` is seen in this process; True if it was logged now."""
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    logger.log(level, message)
    return True

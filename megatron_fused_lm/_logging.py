"""The package logger and a warn-once helper (a message is logged the first time only)."""

import logging

logger = logging.getLogger("megatron_fused_lm")
_already_warned: set = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning unless it was logged before in this process."""
    if message not in _already_warned:
        _already_warned.add(message)
        logger.warning(message)

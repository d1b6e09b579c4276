"""The package logger and log-once helpers (a message is logged the first time only)."""

import logging

logger = logging.getLogger("megatron_fused_lm")
_already_warned: set = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning unless it was logged before in this process."""
    log_once(logging.WARNING, message)


def log_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` unless it was logged before in this process."""
    if message not in _already_warned:
        _already_warned.add(message)
        logger.log(level, message)

"""The three trainer settings that turn the fused LM head on and tune it."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..ops import BACKENDS

# Trainer key -> FusedLMConfig field.
TRAINER_KEYS = {
    "fused_linear_logprob": "enabled",
    "fused_linear_logprob_backend": "backend",
    "logprobs_chunk_size": "chunk_size",
}

_ABSENT = object()


@dataclass(frozen=True)
class FusedLMConfig:
    """Whether ``wrap_model`` fuses the LM head, and how.

    Attributes:
        enabled: fuse the head (``True``) or leave the model stock (``False``, the default).
        backend: ``"torch"``, ``"triton"`` or ``"auto"``, passed to ``fused_linear_logprob``.
        chunk_size: tokens per chunk of the softmax work, a positive int, or ``None`` for the
            op's default.
    """

    enabled: bool = False
    backend: str = "torch"
    chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled (fused_linear_logprob) must be true or false, got {self.enabled!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend (fused_linear_logprob_backend) must be a string, got {self.backend!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"backend (fused_linear_logprob_backend) must be one of {', '.join(map(repr, BACKENDS))}; "
                f"got {self.backend!r}"
            )
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, numbers.Integral):
                raise TypeError(
                    f"chunk_size (logprobs_chunk_size) must be a positive integer or null, got {self.chunk_size!r}"
                )
            if self.chunk_size <= 0:
                raise ValueError(
                    f"chunk_size (logprobs_chunk_size) must be a positive number of tokens or null, "
                    f"got {self.chunk_size}"
                )
            # An Integral that is not an int (numpy.int64, say) is stored as a plain int.
            object.__setattr__(self, "chunk_size", int(self.chunk_size))

    @classmethod
    def from_trainer_config(cls, trainer_config: Any) -> "FusedLMConfig":
        """Read ``fused_linear_logprob``, ``fused_linear_logprob_backend`` and
        ``logprobs_chunk_size`` from a trainer config.

        ``trainer_config`` is a mapping (dict, OmegaConf ``DictConfig``) or an object with
        attributes (argparse ``Namespace``, dataclass). Each key is looked up at the top level and
        under ``trainer``; an absent key (or a ``None`` value) takes the default. A key given in
        both places with different values, an unknown backend or a wrong type raises.
        """
        if trainer_config is None:
            raise TypeError("trainer_config must be a mapping or an object with attributes, got None")
        top_level = _read_keys(trainer_config)
        nested = _lookup(trainer_config, "trainer")
        under_trainer = {} if nested is _ABSENT or nested is None else _read_keys(nested)
        fields: Dict[str, Any] = {}
        for key, field_name in TRAINER_KEYS.items():
            values = [source[key] for source in (top_level, under_trainer) if key in source]
            if len(values) == 2 and values[0] != values[1]:
                raise ValueError(
                    f"{key} is set both at the top level ({values[0]!r}) and under trainer ({values[1]!r})"
                )
            if values:
                fields[field_name] = values[0]
        return cls(**fields)


def _lookup(source: Any, key: str) -> Any:
    if isinstance(source, Mapping):
        return source[key] if key in source else _ABSENT
    return getattr(source, key, _ABSENT)


def _read_keys(source: Any) -> Dict[str, Any]:
    """The trainer keys that ``source`` sets to something other than ``None``."""
    found = {}
    for key in TRAINER_KEYS:
        value = _lookup(source, key)
        if value is not _ABSENT and value is not None:
            found[key] = value
    return found

"""The ops' scalar options, checked once into the one object that carries them across the autograd
boundary (``HeadOptions``), and the schema its fields take in every custom operator
(``OPTIONS_SCHEMA``); the temperature is per row, a tensor (``inputs.row_temperatures``)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch
import torch.distributed as dist

from .._logging import warn_once
from .distributed import group_by_name, group_name
from .triton_support import cute_unavailable_reason, triton_unavailable_reason

BACKENDS = ("torch", "triton", "cute", "auto")


def check_backend(backend: str) -> str:
    """``backend`` if it is one of ``BACKENDS``; ``TypeError`` for a non-string, else ``ValueError``."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    return backend


def checked_number(name: str, value: Union[int, float], *, integral: bool = False) -> Union[int, float]:
    """``value`` as an ``int`` (``integral``) or a ``float``; ``TypeError`` for anything else, a
    ``bool`` included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        raise TypeError(f"{name} must be {'an integer' if integral else 'a number'}, got {value!r}")
    return int(value) if integral else float(value)


def check_vocab_size(vocab_size: Optional[int]) -> Optional[int]:
    """``vocab_size`` as an ``int`` (or ``None``); ``ValueError`` unless it is positive."""
    if vocab_size is None:
        return None
    vocab_size = checked_number("vocab_size", vocab_size, integral=True)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int (the tokenizer's vocabulary) or None, got {vocab_size}")
    return vocab_size


def check_softcap(softcap: Optional[float]) -> Optional[float]:
    """``softcap`` as a ``float`` (or ``None``); ``ValueError`` unless it is positive and finite."""
    if softcap is None:
        return None
    softcap = checked_number("softcap", softcap)
    if not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(
            f"softcap must be a positive finite number (logits = softcap * tanh(logits / softcap)) or None, got {softcap}"
        )
    return softcap


def check_token_chunk(token_chunk: Optional[int]) -> Optional[int]:
    """``token_chunk`` as an ``int`` (or ``None``); ``ValueError`` unless it is positive."""
    if token_chunk is not None and checked_number("token_chunk", token_chunk, integral=True) <= 0:
        raise ValueError(f"token_chunk must be a positive number of tokens or None, got {token_chunk}")
    return None if token_chunk is None else int(token_chunk)


def check_batch_invariant(batch_invariant: bool, backend: str) -> bool:
    """``batch_invariant``; ``TypeError`` unless a bool, ``ValueError`` if true with the torch
    ``backend`` (named or resolved), whose products are cuBLAS's."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    if batch_invariant and backend == "torch":
        raise ValueError(
            "batch_invariant=True needs the Triton backend (backend='triton' or 'auto', on CUDA): the torch "
            "backend's products are cuBLAS's, whose order of summation depends on the number of rows"
        )
    return batch_invariant


def check_weight_grad_scale(weight_grad_scale: float) -> float:
    """``weight_grad_scale`` as a float; ``ValueError`` unless it is finite and not 0 (the held
    hidden gradient is divided by it)."""
    weight_grad_scale = checked_number("weight_grad_scale", weight_grad_scale)
    if weight_grad_scale == 0 or not math.isfinite(weight_grad_scale):
        raise ValueError(f"weight_grad_scale must be a finite nonzero number, got {weight_grad_scale}")
    return weight_grad_scale


def resolved_backend(backend: str, device: torch.device) -> str:
    """The kind of backend a call runs, chosen once per call: ``"triton"`` where ``backend`` is
    ``"triton"`` or ``"auto"`` and Triton can run on ``device``; ``"cute"`` where it is ``"cute"``
    and the CuTe kernels can run there too (else ``"triton"``); otherwise ``"torch"``. Each fallback
    logs one warning. ``"auto"`` does not pick ``"cute"``: it is not yet faster at every shape
    (docs/benchmarks/cute.md)."""
    if check_backend(backend) == "torch":
        return "torch"
    reason = _triton_unavailable_reason(device)
    if reason is not None:
        warn_once(f"backend={backend!r} runs the torch backend instead: {reason}")
        return "torch"
    if backend == "cute":
        reason = _cute_unavailable_reason(device)
        if reason is None:
            return "cute"
        warn_once(f"backend='cute' runs the triton backend instead: {reason}")
    return "triton"


# Facts of the device and the installation: a compiled graph evaluates them once, when traced.
_triton_unavailable_reason = torch.compiler.assume_constant_result(triton_unavailable_reason)
_cute_unavailable_reason = torch.compiler.assume_constant_result(cute_unavailable_reason)


_SCHEMA_TYPES = {
    "str": "str", "Optional[int]": "SymInt?", "Optional[str]": "str?", "bool": "bool", "float": "float",
    "int": "SymInt", "torch.dtype": "ScalarType", "Optional[float]": "float?",
}  # fmt: skip


class Keywords:
    """A frozen dataclass whose fields a custom operator takes as keyword-only parameters of the same
    names (``schema``), and rebuilds by name (``cls(**fields)``): nothing depends on positions."""

    def fields(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def schema(cls) -> str:
        return ", ".join(f"{_SCHEMA_TYPES[field.type]} {field.name}" for field in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class HeadOptions(Keywords):
    """Every option of a fused or unfused call, checked once (``checked``) and kept whole by the pass
    and its autograd function; every custom operator takes all of them (``OPTIONS_SCHEMA``). The
    public ops document each."""

    backend: str = "torch"  # the resolved backend's name (backends.registry.by_name)
    token_chunk: Optional[int] = None  # rows per chunk; None: the path's own rule
    tp_group_name: Optional[str] = None  # the tensor-parallel group by its registered name
    entropy_grad: bool = True
    reduce_hidden_grad: bool = True
    batch_invariant: bool = False
    softcap: Optional[float] = None  # logits = softcap * tanh(products / softcap), before the temperature

    @classmethod
    def checked(
        cls,
        *,
        backend: str,
        token_chunk: Optional[int],
        tp_group: Optional[dist.ProcessGroup],
        entropy_grad: bool = True,
        reduce_hidden_grad: bool = True,
        batch_invariant: bool = False,
        softcap: Optional[float] = None,
    ) -> HeadOptions:
        """The options of a public call whose backend ``backend`` (a name) is resolved already, each
        checked (``TypeError`` / ``ValueError``)."""
        batch_invariant = check_batch_invariant(batch_invariant, backend)
        if batch_invariant and tp_group is not None and dist.get_world_size(tp_group) > 2:
            raise ValueError(
                "batch_invariant=True holds for tensor-parallel groups of up to two ranks: a larger group "
                "sums its ranks' terms in an order that depends on the message's size"
            )
        return cls(
            backend=backend,
            token_chunk=check_token_chunk(token_chunk),
            tp_group_name=group_name(tp_group),
            entropy_grad=bool(entropy_grad),
            reduce_hidden_grad=bool(reduce_hidden_grad),
            batch_invariant=batch_invariant,
            softcap=check_softcap(softcap),
        )

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return group_by_name(self.tp_group_name)


# The keyword-only parameters every custom operator of the ops takes.
OPTIONS_SCHEMA = HeadOptions.schema()

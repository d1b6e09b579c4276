"""The six trainer settings that turn the fused LM head on and tune it.

Each key is the package's own: a trainer's key of its own (SkyRL's and verl's
``logprobs_chunk_size``, which size their logits loops) never reaches the head, whose Triton path
tunes its chunks itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Iterator, Mapping
from typing import Any, Dict, List, Optional, Set, Tuple

from .._logging import warn_once
from ..ops.options import check_backend, check_batch_invariant, check_softcap, check_token_chunk, check_vocab_size

# Trainer key -> FusedLMConfig field.
TRAINER_KEYS = {
    "fused_linear_logprob": "enabled",
    "fused_linear_logprob_backend": "backend",
    "fused_linear_logprob_token_chunk": "token_chunk",
    "fused_linear_logprob_batch_invariant": "batch_invariant",
    "fused_linear_logprob_vocab_size": "vocab_size",
    "fused_linear_logprob_softcap": "softcap",
}

# Trainers' own settings whose names resemble the keys: not misspellings of them.
TRAINERS_OWN_KEYS = (
    "fused_lm_head_logprob",  # SkyRL's fused path (trainer section) and its backend
    "fused_lm_head_logprob_backend",
    "use_fused_linear_logprobs",  # NeMo-RL's Linear-CE fusion (policy.megatron_cfg)
)
# A key spelt with a trainer's own word for it (SkyRL's and verl's logprobs_chunk_size), which
# resembles another key more closely by its letters.
KEYS_BY_TRAINERS_WORDS = {"fused_linear_logprob_chunk_size": "fused_linear_logprob_token_chunk"}
_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class FusedLMConfig:
    """Whether ``wrap_model`` fuses the LM head, and how.

    Attributes:
        enabled: fuse the head (``True``) or leave the model stock (``False``, the default).
        backend: ``"torch"``, ``"triton"``, ``"cute"`` or ``"auto"``, passed to ``fused_linear_logprob``.
        token_chunk: tokens per chunk of the softmax work, a positive int, or ``None`` (the
            default) for the ops' own choice, which on the Triton backend is tuned per shape: a
            smaller chunk trades time for memory (``docs/benchmarks/features.md``, chunk size).
        batch_invariant: ``True`` makes each row's hidden gradient, as its log-prob and entropy
            already are, bitwise independent of the other rows of a call (the ops'
            ``batch_invariant``; the Triton backend only, so ``backend="torch"`` is refused).
        vocab_size: the tokenizer's vocabulary, or ``None`` (the default: every row of the padded
            head, as the stock model). Megatron pads the head to a multiple of
            ``make_vocab_size_divisible_by x TP``; with ``vocab_size`` (Megatron's
            ``args.vocab_size``, a Hugging Face config's ``vocab_size``) the padded ids enter no
            log-sum-exp, entropy, top-k or gradient of the head, as in vLLM's and SGLang's
            log-probs (the ops' ``vocab_size``). The stock logits keep every row.
        softcap: the head's logit softcap, ``logits = softcap * tanh(logits / softcap)`` before the
            temperature (Gemma-2's ``final_logit_softcapping``: 30.0), a positive number, or
            ``None`` (the default: none). Megatron-Core's output layer has no softcap, so its stock
            logits (a forward without a request) stay uncapped, and so does Megatron's own labels
            loss on a stock route (``head.stock_logits()``); every answer of the head (log-probs,
            entropy, top-k, losses and the labels path's loss, on the fused and the stock-logits
            routes) is the capped head's (the ops' ``softcap``).
    """

    enabled: bool = False
    backend: str = "torch"
    token_chunk: Optional[int] = None
    batch_invariant: bool = False
    vocab_size: Optional[int] = None
    softcap: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled (fused_linear_logprob) must be true or false, got {self.enabled!r}")
        checks = (
            ("backend", check_backend),
            ("token_chunk", check_token_chunk),
            ("vocab_size", check_vocab_size),
            ("softcap", check_softcap),
        )
        for field_name, check in checks:
            key = next(key for key, name in TRAINER_KEYS.items() if name == field_name)
            try:
                # The op's own check, which also stores an Integral that is not an int as an int.
                object.__setattr__(self, field_name, check(getattr(self, field_name)))
            except (TypeError, ValueError) as error:
                raise type(error)(f"{key}: {error}") from None
        try:  # the ops' own check, on the backend as named (the ops see it resolved)
            check_batch_invariant(self.batch_invariant, self.backend)
        except (TypeError, ValueError) as error:
            raise type(error)(f"fused_linear_logprob_batch_invariant: {error}") from None

    @classmethod
    def from_trainer_config(cls, trainer_config: Any, section: Optional[str] = None) -> "FusedLMConfig":
        """Read ``fused_linear_logprob``, ``fused_linear_logprob_backend``,
        ``fused_linear_logprob_token_chunk``, ``fused_linear_logprob_batch_invariant``,
        ``fused_linear_logprob_vocab_size`` and ``fused_linear_logprob_softcap`` from a trainer config.

        Args:
            trainer_config: a mapping (dict, OmegaConf ``DictConfig``) or an object with attributes
                (argparse ``Namespace``, dataclass), sections nested the same way.
            section: the dotted path of the section that holds the keys, e.g.
                ``"actor_rollout_ref.actor.megatron"`` (verl's actor engine section, which its engine
                hands to the recipe). The keys are then read there only; a ``None`` (null) section
                reads as empty, and a path that does not lead to a section raises ``ValueError``.
                Where the section leaves the head off while the config sets a key elsewhere (above
                the section, beside it or below it), one warning names where, and the ``section=``
                that reads it.

        Without ``section``, each key is looked up at the top level and under ``trainer``; an
        absent or ``None`` key takes the default; a key given in both places with different
        values, an unknown backend or a wrong type raises. A key set only in a deeper section is
        ignored with one warning naming its dotted path and the ``section=`` that reads it (a config
        may hold keys for several models: verl's actor, its reference, a critic). A name that looks
        like a misspelt key (``fused_linear_logprobs``, ``fused_logprob``) is ignored with one
        warning naming the key; keys that tune the head without ``fused_linear_logprob``, which
        turns it on, warn once too. The trainers' own similar names (SkyRL's
        ``fused_lm_head_logprob``, NeMo-RL's ``use_fused_linear_logprobs``) are theirs, not
        misspellings.
        """
        if trainer_config is None:
            raise TypeError("trainer_config must be a mapping or an object with attributes, got None")
        if section is not None:
            chosen = _section(trainer_config, section)
            read = _read_keys(chosen)
            config = cls(**{TRAINER_KEYS[key]: value for key, value in read.items()})
            _warn_of_misspellings([(f"{section}.", chosen)], config)
            if not config.enabled:  # what was meant to turn it on may sit above, beside or below the section
                elsewhere = [
                    path for path, key in _set_keys_below(trainer_config) if path.rpartition(".")[0] != section
                ]
                _warn_of_keys_elsewhere(f"read section={section!r}", elsewhere, config)
                _warn_without_the_switch([f"{section}.{key}" for key in read], config)
            return config
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
        config = cls(**fields)
        _warn_of_misspellings([("", trainer_config), ("trainer.", None if nested is _ABSENT else nested)], config)
        missing = {key for key in TRAINER_KEYS if key not in top_level and key not in under_trainer}
        elsewhere = [path for path, key in _set_keys_below(trainer_config) if key in missing]
        _warn_of_keys_elsewhere("reads its keys at the top level and under 'trainer'", elsewhere, config)
        if not config.enabled:
            _warn_without_the_switch([*top_level, *(f"trainer.{key}" for key in under_trainer)], config)
        return config


def _warn_of_keys_elsewhere(where: str, elsewhere: List[str], config: FusedLMConfig) -> None:
    """One warning naming the dotted paths of the keys set where ``from_trainer_config`` did not
    read (``where`` says where it did), and the ``section=`` that reads the first."""
    if elsewhere:
        warn_once(
            f"megatron_fused_lm: FusedLMConfig.from_trainer_config {where}, and ignored {', '.join(elsewhere)}: the "
            f"config reads as {config}. To read them, pass section={elsewhere[0].rpartition('.')[0]!r} (the dotted "
            "path of the section that holds them)."
        )


def _warn_without_the_switch(paths: List[str], config: FusedLMConfig) -> None:
    """One warning where the keys read (their dotted ``paths``) tune the fused head but none turns
    it on."""
    if paths:
        warn_once(
            f"megatron_fused_lm: FusedLMConfig.from_trainer_config read {', '.join(paths)} but no "
            f"fused_linear_logprob, which turns the fused head on: the config reads as {config}, and wrap_model "
            "leaves the model stock."
        )


def _warn_of_misspellings(sections: List[Tuple[str, Any]], config: FusedLMConfig) -> None:
    """One warning for the names of the ``(dotted prefix, section)`` pairs that resemble a trainer
    key without being one (after lower-casing and reading '-' as '_')."""
    suspects = []
    for prefix, section in sections:
        for name in _names(section) or ():
            if not isinstance(name, str) or name in TRAINER_KEYS:
                continue
            if name in TRAINERS_OWN_KEYS:
                continue
            spelt = name.lower().replace("-", "_")
            if spelt in KEYS_BY_TRAINERS_WORDS:
                close = [KEYS_BY_TRAINERS_WORDS[spelt]]
            else:
                close = difflib.get_close_matches(spelt, TRAINER_KEYS, n=1, cutoff=0.75)
            if close:
                suspects.append(f"{prefix}{name} (did you mean {close[0]}?)")
    if suspects:
        warn_once(
            f"megatron_fused_lm: FusedLMConfig.from_trainer_config ignored {', '.join(suspects)}, which "
            f"{'is' if len(suspects) == 1 else 'are'} not among its keys ({', '.join(TRAINER_KEYS)}): the "
            f"config reads as {config}."
        )


def _lookup(source: Any, key: str) -> Any:
    if isinstance(source, Mapping):
        try:
            return source[key]
        except (KeyError, AttributeError):  # verl's BaseConfig answers a missing key with AttributeError
            return _ABSENT
    return getattr(source, key, _ABSENT)


def _read_keys(source: Any) -> Dict[str, Any]:
    """The trainer keys that ``source`` sets to something other than ``None``."""
    found = {}
    for key in TRAINER_KEYS:
        value = _lookup(source, key)
        if value is not _ABSENT and value is not None:
            found[key] = value
    return found


def _names(source: Any) -> Optional[List[Any]]:
    """The names of ``source``'s entries if it is a config section, else ``None``.

    A section is a mapping, a dataclass instance or an object with attributes in ``__dict__``
    (``Namespace``); callables are not (a model or tokenizer carried in a config holds no settings).
    """
    if isinstance(source, Mapping):
        return list(source.keys())
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return [field.name for field in dataclasses.fields(source)]
    if hasattr(source, "__dict__") and not callable(source) and not isinstance(source, types.ModuleType):
        return list(vars(source))
    return None


def _section(trainer_config: Any, section: str) -> Any:
    """The section of ``trainer_config`` at the dotted path ``section`` (``None`` for a null one)."""
    if not isinstance(section, str):
        raise TypeError(f"section must be a dotted path such as 'actor_rollout_ref.actor', got {section!r}")
    parts = section.split(".")
    if not all(parts):
        raise ValueError(f"section must be a dotted path of names such as 'actor_rollout_ref.actor', got {section!r}")
    node, where = trainer_config, "the config"
    for depth, part in enumerate(parts):
        names = _names(node)
        if names is None:
            raise ValueError(f"section {section!r} not found: {where} is a {type(node).__name__}, not a section")
        node = _lookup(node, part)
        if node is _ABSENT:
            listed = ", ".join(repr(str(name)) for name in sorted(names, key=str))
            raise ValueError(f"section {section!r} not found: {where} has no {part!r}; it has {listed}")
        where = repr(".".join(parts[: depth + 1]))
    if node is not None and _names(node) is None:
        raise ValueError(f"section {section!r} is a {type(node).__name__}, not a section")
    return node


def _set_keys_below(source: Any, path: str = "", seen: Optional[Set[int]] = None) -> Iterator[Tuple[str, str]]:
    """``(dotted path, key)`` of every trainer key set (not ``None``) in ``source`` or any section
    below it, in the config's order."""
    seen = set() if seen is None else seen
    names = _names(source)
    if names is None or id(source) in seen:  # a section reachable twice (or a cycle) is read once
        return
    seen.add(id(source))
    for name in names:
        try:
            value = source[name] if isinstance(source, Mapping) else getattr(source, name)
        except Exception:
            # The search only advises: an entry that fails to read (OmegaConf's mandatory '???', an
            # interpolation to a missing key) must not break reading the config.
            continue
        child_path = f"{path}{name}"
        if name in TRAINER_KEYS:
            if value is not None:
                yield child_path, name
        else:
            yield from _set_keys_below(value, f"{child_path}.", seen)

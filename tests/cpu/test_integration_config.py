"""FusedLMConfig and reading it from trainer configs of every common shape."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from megatron_fused_lm.integration import FusedLMConfig

SETTINGS = {"fused_linear_logprob": True, "fused_linear_logprob_backend": "auto", "logprobs_chunk_size": 256}
EXPECTED = FusedLMConfig(enabled=True, backend="auto", chunk_size=256)


@dataclass
class TrainerSection:
    fused_linear_logprob: bool = True
    fused_linear_logprob_backend: str = "auto"
    logprobs_chunk_size: Optional[int] = 256


@dataclass
class TrainerConfig:
    learning_rate: float = 1e-5
    trainer: TrainerSection = field(default_factory=TrainerSection)


class AttributeConfig:
    """Attribute access only, as OmegaConf's DictConfig offers besides its mapping interface."""

    def __init__(self, **values):
        self.__dict__.update(values)


@pytest.mark.parametrize(
    "trainer_config",
    [
        SETTINGS,
        {"trainer": SETTINGS, "seed": 1},
        argparse.Namespace(**SETTINGS),
        argparse.Namespace(trainer=argparse.Namespace(**SETTINGS)),
        TrainerConfig(),
        AttributeConfig(trainer=AttributeConfig(**SETTINGS)),
        {"fused_linear_logprob": True, "trainer": {"fused_linear_logprob_backend": "auto", "logprobs_chunk_size": 256}},
    ],
    ids=["dict", "nested dict", "namespace", "nested namespace", "dataclass", "attributes", "split"],
)
def test_reads_the_three_keys(trainer_config):
    assert FusedLMConfig.from_trainer_config(trainer_config) == EXPECTED


@pytest.mark.parametrize(
    "trainer_config",
    [{}, {"trainer": {}}, {"trainer": None}, argparse.Namespace(lr=1.0), {"fused_linear_logprob": None}],
)
def test_absent_keys_take_the_defaults(trainer_config):
    assert FusedLMConfig.from_trainer_config(trainer_config) == FusedLMConfig()
    assert FusedLMConfig() == FusedLMConfig(enabled=False, backend="torch", chunk_size=None)


def test_example_yaml_enables_the_fused_head():
    import yaml

    path = Path(__file__).resolve().parents[2] / "examples" / "trainer_config.yaml"
    config = FusedLMConfig.from_trainer_config(yaml.safe_load(path.read_text()))
    assert config.enabled


@pytest.mark.parametrize(
    "settings, error, words",
    [
        ({"fused_linear_logprob_backend": "cuda"}, ValueError, "backend"),
        ({"fused_linear_logprob_backend": 3}, TypeError, "fused_linear_logprob_backend"),
        ({"fused_linear_logprob": "yes"}, TypeError, "fused_linear_logprob"),
        ({"fused_linear_logprob": 1}, TypeError, "fused_linear_logprob"),
        ({"logprobs_chunk_size": 0}, ValueError, "logprobs_chunk_size"),
        ({"logprobs_chunk_size": -4}, ValueError, "logprobs_chunk_size"),
        ({"logprobs_chunk_size": 2.5}, TypeError, "logprobs_chunk_size"),
        ({"logprobs_chunk_size": "256"}, TypeError, "logprobs_chunk_size"),
        ({"logprobs_chunk_size": True}, TypeError, "logprobs_chunk_size"),
    ],
)
def test_bad_values_raise(settings, error, words):
    with pytest.raises(error, match=words):
        FusedLMConfig.from_trainer_config(settings)
    with pytest.raises(error, match=words):
        FusedLMConfig.from_trainer_config(argparse.Namespace(trainer=argparse.Namespace(**settings)))


def test_conflicting_places_raise():
    with pytest.raises(ValueError, match="both at the top level"):
        FusedLMConfig.from_trainer_config({"logprobs_chunk_size": 8, "trainer": {"logprobs_chunk_size": 16}})
    assert (
        FusedLMConfig.from_trainer_config({"logprobs_chunk_size": 8, "trainer": {"logprobs_chunk_size": 8}}).chunk_size
        == 8
    )


def test_not_a_config_raises():
    with pytest.raises(TypeError):
        FusedLMConfig.from_trainer_config(None)


def test_wrap_model_wants_a_config():
    from megatron_fused_lm.integration import wrap_model

    with pytest.raises(TypeError, match="FusedLMConfig"):
        wrap_model(object(), {"fused_linear_logprob": True})

"""FusedLMConfig and reading it from trainer configs of every common shape."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from megatron_fused_lm.integration import FusedLMConfig

SETTINGS = {
    "fused_linear_logprob": True,
    "fused_linear_logprob_backend": "auto",
    "fused_linear_logprob_token_chunk": 256,
    "fused_linear_logprob_batch_invariant": True,
}
EXPECTED = FusedLMConfig(enabled=True, backend="auto", token_chunk=256, batch_invariant=True)


@dataclass
class TrainerSection:
    fused_linear_logprob: bool = True
    fused_linear_logprob_backend: str = "auto"
    fused_linear_logprob_token_chunk: Optional[int] = 256
    fused_linear_logprob_batch_invariant: bool = True


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
        {
            "fused_linear_logprob": True,
            "fused_linear_logprob_batch_invariant": True,
            "trainer": {"fused_linear_logprob_backend": "auto", "fused_linear_logprob_token_chunk": 256},
        },
    ],
    ids=["dict", "nested dict", "namespace", "nested namespace", "dataclass", "attributes", "split"],
)
def test_reads_the_four_keys(trainer_config):
    assert FusedLMConfig.from_trainer_config(trainer_config) == EXPECTED


@pytest.mark.parametrize(
    "trainer_config",
    [{}, {"trainer": {}}, {"trainer": None}, argparse.Namespace(lr=1.0), {"fused_linear_logprob": None}],
)
def test_absent_keys_take_the_defaults(trainer_config):
    assert FusedLMConfig.from_trainer_config(trainer_config) == FusedLMConfig()
    assert FusedLMConfig() == FusedLMConfig(enabled=False, backend="torch", token_chunk=None, batch_invariant=False)


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
        ({"fused_linear_logprob_token_chunk": 0}, ValueError, "fused_linear_logprob_token_chunk"),
        ({"fused_linear_logprob_token_chunk": -4}, ValueError, "fused_linear_logprob_token_chunk"),
        ({"fused_linear_logprob_token_chunk": 2.5}, TypeError, "fused_linear_logprob_token_chunk"),
        ({"fused_linear_logprob_token_chunk": "256"}, TypeError, "fused_linear_logprob_token_chunk"),
        ({"fused_linear_logprob_token_chunk": True}, TypeError, "fused_linear_logprob_token_chunk"),
        ({"fused_linear_logprob_batch_invariant": "yes"}, TypeError, "fused_linear_logprob_batch_invariant"),
        (
            {"fused_linear_logprob_batch_invariant": True},
            ValueError,
            "fused_linear_logprob_batch_invariant: .*Triton backend",
        ),
    ],
)
def test_bad_values_raise(settings, error, words):
    with pytest.raises(error, match=words):
        FusedLMConfig.from_trainer_config(settings)
    with pytest.raises(error, match=words):
        FusedLMConfig.from_trainer_config(argparse.Namespace(trainer=argparse.Namespace(**settings)))


def test_conflicting_places_raise():
    with pytest.raises(ValueError, match="both at the top level"):
        FusedLMConfig.from_trainer_config(
            {"fused_linear_logprob_token_chunk": 8, "trainer": {"fused_linear_logprob_token_chunk": 16}}
        )
    assert (
        FusedLMConfig.from_trainer_config(
            {"fused_linear_logprob_token_chunk": 8, "trainer": {"fused_linear_logprob_token_chunk": 8}}
        ).token_chunk
        == 8
    )


def test_not_a_config_raises():
    with pytest.raises(TypeError):
        FusedLMConfig.from_trainer_config(None)


def test_wrap_model_wants_a_config():
    from megatron_fused_lm.integration import wrap_model

    with pytest.raises(TypeError, match="FusedLMConfig"):
        wrap_model(object(), {"fused_linear_logprob": True})


# verl-style: the settings sit with the actor, the top-level `trainer:` holds other things, and the
# reference policy has a section of its own.
VERL_LIKE = {
    "trainer": {"project_name": "grpo", "total_epochs": 1},
    "actor_rollout_ref": {
        "actor": {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 2}, **SETTINGS},
        "ref": {"fused_linear_logprob_token_chunk": 64, "fused_linear_logprob": None},
    },
}


def namespaces(value):
    """The same config as nested argparse Namespaces (attribute access only)."""
    if isinstance(value, dict):
        return argparse.Namespace(**{key: namespaces(item) for key, item in value.items()})
    return value


@pytest.mark.parametrize("build", [dict, namespaces], ids=["dict", "namespace"])
def test_keys_in_another_section_are_ignored_with_one_warning(build, package_warnings):
    config = build(VERL_LIKE)
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig()
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig()  # read twice, warned once
    [warning] = package_warnings()
    for path in (
        "actor_rollout_ref.actor.fused_linear_logprob",
        "actor_rollout_ref.actor.fused_linear_logprob_backend",
        "actor_rollout_ref.actor.fused_linear_logprob_token_chunk",
        "actor_rollout_ref.ref.fused_linear_logprob_token_chunk",
    ):
        assert path in warning
    assert "actor_rollout_ref.ref.fused_linear_logprob," not in warning  # None is not set
    assert "ignored" in warning and "enabled=False" in warning
    assert "section='actor_rollout_ref.actor'" in warning


def test_only_the_keys_missing_where_looked_are_reported(package_warnings):
    config = {
        "fused_linear_logprob": True,
        "actor": {"fused_linear_logprob": False, "fused_linear_logprob_token_chunk": 32},
    }
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig(enabled=True)
    [warning] = package_warnings()
    assert "actor.fused_linear_logprob_token_chunk" in warning and "actor.fused_linear_logprob," not in warning


@pytest.mark.parametrize(
    "trainer_config",
    [SETTINGS, {"trainer": SETTINGS, "actor": {"strategy": "fsdp"}}, {}, {"actor": {"fused_linear_logprob": None}}],
)
def test_no_warning_when_nothing_is_elsewhere(trainer_config, package_warnings):
    FusedLMConfig.from_trainer_config(trainer_config)
    assert package_warnings() == []


@pytest.mark.parametrize("build", [dict, namespaces, lambda value: AttributeConfig(**value)])
def test_section_reads_the_keys_there(build, package_warnings):
    config = build(VERL_LIKE)
    assert FusedLMConfig.from_trainer_config(config, section="actor_rollout_ref.actor") == EXPECTED
    assert package_warnings() == []  # a section that turns the head on silences the search
    ref = FusedLMConfig.from_trainer_config(config, section="actor_rollout_ref.ref")
    assert ref == FusedLMConfig(token_chunk=64)
    # It tunes the head without turning it on, while the actor's section turns it on: both said.
    elsewhere, switch = package_warnings()
    assert "ignored actor_rollout_ref.actor.fused_linear_logprob," in elsewhere
    assert "section='actor_rollout_ref.actor'" in elsewhere
    assert "read actor_rollout_ref.ref.fused_linear_logprob_token_chunk but no" in switch
    assert "wrap_model leaves the model stock" in switch


@pytest.mark.parametrize("build", [dict, namespaces], ids=["dict", "namespace"])
def test_a_section_whose_keys_sit_one_level_deeper_warns_naming_that_section(build, package_warnings):
    config = build({"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": dict(SETTINGS)}}})
    assert FusedLMConfig.from_trainer_config(config, section="actor_rollout_ref.actor") == FusedLMConfig()
    [warning] = package_warnings()
    assert "actor_rollout_ref.actor.megatron.fused_linear_logprob," in warning and "enabled=False" in warning
    assert "section='actor_rollout_ref.actor.megatron'" in warning
    assert FusedLMConfig.from_trainer_config(config, section="actor_rollout_ref.actor.megatron") == EXPECTED


def test_a_section_that_sets_a_key_reads_only_there_without_a_warning(package_warnings):
    config = {"actor": {"fused_linear_logprob": True, "megatron": {"fused_linear_logprob_token_chunk": 8}}}
    assert FusedLMConfig.from_trainer_config(config, section="actor") == FusedLMConfig(enabled=True)
    assert package_warnings() == []


def test_section_reads_only_there():
    config = {
        "fused_linear_logprob": True,
        "trainer": {"fused_linear_logprob_token_chunk": 8},
        "actor": {},
        "critic": None,
    }
    assert FusedLMConfig.from_trainer_config(config, section="actor") == FusedLMConfig()
    assert FusedLMConfig.from_trainer_config(config, section="critic") == FusedLMConfig()  # null: an empty section
    assert FusedLMConfig.from_trainer_config(config, section="trainer") == FusedLMConfig(token_chunk=8)
    assert FusedLMConfig.from_trainer_config(TrainerConfig(), section="trainer") == EXPECTED


@pytest.mark.parametrize(
    "section, error, words",
    [
        ("actor_rollout_ref.actr", ValueError, r"'actor_rollout_ref' has no 'actr'; it has 'actor', 'ref'"),
        ("critic", ValueError, r"the config has no 'critic'; it has 'actor_rollout_ref', 'trainer'"),
        ("trainer.project_name", ValueError, r"section 'trainer.project_name' is a str, not a section"),
        ("trainer.project_name.x", ValueError, r"'trainer.project_name' is a str, not a section"),
        ("actor_rollout_ref..actor", ValueError, "dotted path"),
        ("", ValueError, "dotted path"),
        (["actor_rollout_ref", "actor"], TypeError, "section must be a dotted path"),
    ],
)
def test_a_bad_section_raises(section, error, words):
    for build in (dict, namespaces):
        with pytest.raises(error, match=words):
            FusedLMConfig.from_trainer_config(build(VERL_LIKE), section=section)


@pytest.mark.parametrize(
    "settings, section, suspect, key",
    [
        ({"fused_linear_logprobs": True}, None, "fused_linear_logprobs", "fused_linear_logprob"),
        (
            {"trainer": {"fused_linear_logprob_backed": "triton"}},
            None,
            "trainer.fused_linear_logprob_backed",
            "fused_linear_logprob_backend",
        ),
        (
            {"fused_linear_logprob_chunk_size": 64},
            None,
            "fused_linear_logprob_chunk_size",
            "fused_linear_logprob_token_chunk",
        ),
        ({"Fused-Linear-Logprob": True}, None, "Fused-Linear-Logprob", "fused_linear_logprob"),
        ({"actor": {"fused_linear_logprobs": True}}, "actor", "actor.fused_linear_logprobs", "fused_linear_logprob"),
    ],
)
def test_a_misspelt_key_warns_once_naming_the_key(settings, section, suspect, key, package_warnings):
    for build in (dict, namespaces):
        assert FusedLMConfig.from_trainer_config(build(settings), section=section) == FusedLMConfig()
    [warning] = package_warnings()  # read twice, warned once
    assert f"{suspect} (did you mean {key}?)" in warning and "enabled=False" in warning


def test_the_misspelling_warning_lists_every_suspect_and_ignores_other_keys(package_warnings):
    config = {
        "fused_linear_logprobs": True,
        "fused_linear_logprob_backend": "auto",
        "trainer": {"fused_linear_logprob_token_chunks": 8, "log_prob_micro_batch_size": 4, "use_fused_kernels": True},
        "entropy_coeff": 0.0,
    }
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig(backend="auto")
    warning, switch = package_warnings()  # the second: a backend set, the switch misspelt
    assert "read fused_linear_logprob_backend but no fused_linear_logprob" in switch
    assert "fused_linear_logprobs (did you mean fused_linear_logprob?)" in warning
    assert "trainer.fused_linear_logprob_token_chunks (did you mean fused_linear_logprob_token_chunk?)" in warning
    for other in ("log_prob_micro_batch_size", "use_fused_kernels", "entropy_coeff", "fused_linear_logprob_backend ("):
        assert other not in warning


@pytest.mark.parametrize("build", [dict, namespaces], ids=["dict", "namespace"])
def test_a_trainers_own_chunk_size_is_not_read(build, package_warnings):
    # SkyRL's trainer.logprobs_chunk_size (default 1024) and verl's size their own logits loops; read
    # as the head's chunk they slowed its tuned Triton path by 20 %: they never reach it, silently.
    config = build({"trainer": {"fused_linear_logprob": True, "logprobs_chunk_size": 1024}})
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig(enabled=True)
    assert FusedLMConfig.from_trainer_config(config, section="trainer") == FusedLMConfig(enabled=True)
    assert package_warnings() == []


@pytest.mark.parametrize("build", [dict, namespaces], ids=["dict", "namespace"])
@pytest.mark.parametrize(
    "settings, section, where",
    [
        # One level above the section read (verl's engine section is actor_rollout_ref.actor.megatron).
        ({"actor_rollout_ref": {"actor": {**SETTINGS, "megatron": {"seed": 1}}}}, "actor_rollout_ref.actor.megatron",
         "actor_rollout_ref.actor.fused_linear_logprob,"),
        # Beside it.
        ({"policy": {"megatron_cfg": {}}, "generation": dict(SETTINGS)}, "policy", "generation.fused_linear_logprob,"),
        # At the top, reading a section.
        ({**SETTINGS, "policy": {"seed": 1}}, "policy", "ignored fused_linear_logprob,"),
    ],
    ids=["above", "beside", "top"],
)  # fmt: skip
def test_keys_outside_the_section_read_warn_where_the_head_stays_off(build, settings, section, where, package_warnings):
    assert FusedLMConfig.from_trainer_config(build(settings), section=section) == FusedLMConfig()
    [warning] = package_warnings()
    assert where in warning and "enabled=False" in warning, warning


@pytest.mark.parametrize("section", [None, "trainer"])
def test_tuning_keys_without_the_switch_warn(section, package_warnings):
    config = {"trainer": {"fused_linear_logprob_backend": "triton"}}
    assert FusedLMConfig.from_trainer_config(config, section=section) == FusedLMConfig(backend="triton")
    [warning] = package_warnings()
    assert "read trainer.fused_linear_logprob_backend but no" in warning and "fused_linear_logprob, which" in warning


@pytest.mark.parametrize("name", ["fused_logprob", "fused_logprobs", "fused_linear"])
def test_a_near_miss_of_the_switch_warns(name, package_warnings):
    assert FusedLMConfig.from_trainer_config({"trainer": {name: True}}) == FusedLMConfig()
    [warning] = package_warnings()
    assert f"trainer.{name} (did you mean fused_linear_logprob?)" in warning


def test_the_trainers_own_fused_keys_are_not_misspellings(package_warnings):
    # SkyRL's trainer section has fused_lm_head_logprob, NeMo-RL's policy.megatron_cfg has
    # use_fused_linear_logprobs: their own fused paths, set off in every default config.
    config = {
        "trainer": {
            "fused_linear_logprob": True,
            "fused_lm_head_logprob": False,
            "fused_lm_head_logprob_backend": "torch",
        }
    }
    assert FusedLMConfig.from_trainer_config(config) == FusedLMConfig(enabled=True)
    policy = {"fused_linear_logprob": True, "use_fused_linear_logprobs": False}
    assert FusedLMConfig.from_trainer_config({"policy": policy}, section="policy") == FusedLMConfig(enabled=True)
    assert package_warnings() == []


class AttributeMapping(dict):
    """A mapping that answers a missing key with AttributeError, as verl's BaseConfig (a dataclass
    that is also a Mapping) does: ``in`` then raises instead of answering False."""

    def __getitem__(self, key):
        try:
            return super().__getitem__(key)
        except KeyError:
            raise AttributeError(key) from None

    def __contains__(self, key):
        self[key]
        return True


def test_a_mapping_that_raises_attribute_error_reads_as_verls_config():
    assert FusedLMConfig.from_trainer_config(AttributeMapping(SETTINGS)) == EXPECTED
    assert FusedLMConfig.from_trainer_config(AttributeMapping(SETTINGS), section=None) == EXPECTED

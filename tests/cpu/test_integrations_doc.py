"""docs/INTEGRATIONS.md shows the recipes as they are, and its configuration examples switch the fused
head on where they say they do:

1. every ``python`` block is verbatim in one of ``megatron_fused_lm/recipes/*.py`` (which
   test_recipes.py and test_skyrl_parity.py run), and every recipe module is shown;
2. every ``yaml`` block starts with the ``from_trainer_config`` call its trainer makes, naming the
   ``section=`` it reads; read there, the block enables the fused head with the backend it sets;
3. the ``bash`` block (slime's command line) parses with the slime recipe's flags into ``args`` that
   enable it.
"""

import argparse
import re
import shlex
from pathlib import Path

import yaml

from megatron_fused_lm import FusedLMConfig
from megatron_fused_lm.recipes import slime

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = (ROOT / "docs" / "INTEGRATIONS.md").read_text()
RECIPES = {path.stem: path.read_text() for path in (ROOT / "megatron_fused_lm" / "recipes").glob("*.py")}
SECTION_COMMENT = re.compile(r'# FusedLMConfig\.from_trainer_config\(config, section="([^"]+)"\)')


def blocks(language: str) -> list:
    """The document's fenced blocks of ``language``, their text."""
    return re.findall(rf"^```{language}\n(.*?)^```", DOCUMENT, flags=re.S | re.M)


def test_python_blocks_are_the_recipes_code():
    shown = set()
    for block in blocks("python"):
        modules = [name for name, source in RECIPES.items() if block in source]
        assert modules, f"a block is not in megatron_fused_lm/recipes verbatim:\n{block[:400]}"
        shown.update(modules)
    assert shown == set(RECIPES) - {"__init__"}, f"recipe modules the document does not show: {set(RECIPES) - shown}"


def test_configuration_examples_enable_the_fused_head():
    examples = blocks("yaml")
    assert len(examples) == 3  # SkyRL, verl, NeMo-RL
    for block in examples:
        call = SECTION_COMMENT.match(block)
        assert call, f"the block does not start with the from_trainer_config call its trainer makes:\n{block}"
        config = FusedLMConfig.from_trainer_config(yaml.safe_load(block), section=call.group(1))
        assert config.enabled and config.backend == "auto", (call.group(1), config)


def test_slime_command_line_enables_the_fused_head():
    [block] = blocks("bash")
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["python", "train.py"]
    args, _ = slime.add_fused_lm_arguments(argparse.ArgumentParser()).parse_known_args(words[2:])
    assert FusedLMConfig.from_trainer_config(args) == FusedLMConfig(enabled=True, backend="auto")

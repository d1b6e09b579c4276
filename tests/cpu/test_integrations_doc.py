"""docs/INTEGRATIONS.md and its trainer pages (docs/trainers/<trainer>.md) show the recipes as they
are, and their configuration examples switch the fused head on where they say they do:

1. there is one page per recipe module, each page links its recipe file (the link resolving) and
   INTEGRATIONS.md links every page; every relative link of these documents resolves, anchors
   included;
2. every ``python`` block on a page is either an excerpt of its recipe (no import from
   ``megatron_fused_lm``: each non-blank line is a line of ``megatron_fused_lm/recipes/<trainer>.py``,
   in order) or a snippet of the calls a user adds (it imports from ``megatron_fused_lm``: each
   imported name exists, is public and is used, recipe names come from the page's own recipe, and
   each call of an imported name, directly or through ``functools.partial``, binds to its
   signature); every ``megatron_fused_lm.recipes.<trainer>.<name>`` the documents mention exists;
3. every ``yaml`` block starts with the ``from_trainer_config`` call its trainer makes, naming the
   ``section=`` it reads; read there, the block enables the fused head with the backend it sets;
4. the ``bash`` block (slime's command line) parses with the slime recipe's flags into ``args`` that
   enable it;
5. INTEGRATIONS.md's table of settings names the keys ``from_trainer_config`` reads, with their
   defaults.
"""

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import shlex
from pathlib import Path

import yaml

from megatron_fused_lm import FusedLMConfig
from megatron_fused_lm.integration.config import TRAINER_KEYS
from megatron_fused_lm.recipes import slime

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "INTEGRATIONS.md"
RECIPES = {path.stem: path for path in (ROOT / "megatron_fused_lm" / "recipes").glob("*.py") if path.stem != "__init__"}
PAGES = {path.stem: path for path in (ROOT / "docs" / "trainers").glob("*.md")}
DOCUMENTS = [INDEX, *PAGES.values()]
SECTION_COMMENT = re.compile(r'# FusedLMConfig\.from_trainer_config\(config, section="([^"]+)"\)')
LINK = re.compile(r"\]\(([^)\s]+)\)")
YAML_BLOCKS = {"skyrl": 1, "verl": 1, "slime": 0, "nemo_rl": 1}


def blocks(text: str, language: str) -> list:
    """The fenced blocks of ``language`` in ``text``, their text."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def links(path: Path) -> list:
    """The relative link targets of a document, without the external ones."""
    return [target for target in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", target)]


def anchors(path: Path) -> set:
    """GitHub's anchors of a Markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_one_page_per_recipe_linking_its_recipe():
    assert set(PAGES) == set(RECIPES), f"pages {sorted(PAGES)} vs recipe modules {sorted(RECIPES)}"
    for trainer, page in PAGES.items():
        recipe = RECIPES[trainer]
        linked = {(page.parent / target.split("#")[0]).resolve() for target in links(page)}
        assert recipe.resolve() in linked, f"{page.name} does not link {recipe.relative_to(ROOT)}"
    index_links = {(INDEX.parent / target.split("#")[0]).resolve() for target in links(INDEX)}
    assert set(path.resolve() for path in PAGES.values()) <= index_links, "INTEGRATIONS.md misses a trainer page"


def test_relative_links_resolve():
    for document in DOCUMENTS:
        for target in links(document):
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            assert resolved.exists(), f"{document.name}: {target} does not exist"
            if anchor:
                assert anchor in anchors(resolved), f"{document.name}: no heading for #{anchor} in {resolved.name}"


def excerpt_lines_in_order(block: str, source: str) -> None:
    """Each non-blank line of ``block`` is a line of ``source``, after the previous one's."""
    lines = [line.rstrip() for line in source.splitlines()]
    at = 0
    for line in filter(str.strip, block.splitlines()):
        try:
            at = lines.index(line.rstrip(), at) + 1
        except ValueError:
            raise AssertionError(f"not in the recipe (in this order): {line!r}\n{block}") from None


def bind(function, call: ast.Call, skip: int = 0) -> None:
    """``function``'s signature takes ``call``'s arguments (after the first ``skip``), as far as they
    can be read: a call with ``*`` or ``**`` arguments is not checked."""
    arguments = call.args[skip:]
    if any(isinstance(argument, ast.Starred) for argument in arguments) or any(k.arg is None for k in call.keywords):
        return
    try:
        bound = inspect.signature(function).bind_partial if skip else inspect.signature(function).bind
        bound(*range(len(arguments)), **{keyword.arg: None for keyword in call.keywords})
    except TypeError as error:
        raise AssertionError(f"{ast.unparse(call)}: {error}") from None


def check_snippet(block: str, trainer: str) -> None:
    """The block's imports from ``megatron_fused_lm`` exist, are public, come from the page's own
    recipe and are used; its calls of them bind to their signatures."""
    tree = ast.parse(block)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_fused_lm"):
            recipe = re.fullmatch(r"megatron_fused_lm\.recipes\.(\w+)", node.module)
            assert recipe is None or recipe.group(1) == trainer, f"{node.module} on the {trainer} page"
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert not alias.name.startswith("_"), f"{alias.name} is private"
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    assert imported, f"a snippet that imports nothing from megatron_fused_lm:\n{block}"
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert set(imported) <= used, f"imported and not used: {set(imported) - used}\n{block}"
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        name = ast.unparse(call.func)
        if name in imported:
            bind(imported[name], call)
        elif name == "functools.partial" and call.args and ast.unparse(call.args[0]) in imported:
            bind(imported[ast.unparse(call.args[0])], call, skip=1)


def test_python_blocks_are_the_recipes_code():
    for trainer, page in PAGES.items():
        source = RECIPES[trainer].read_text()
        shown = blocks(page.read_text(), "python")
        assert shown, f"{page.name} shows no code"
        for block in shown:
            if re.search(r"^\s*(from|import) megatron_fused_lm", block, flags=re.M):
                check_snippet(block, trainer)
            else:
                excerpt_lines_in_order(block, source)
    assert not blocks(INDEX.read_text(), "python"), "INTEGRATIONS.md is an index: code goes on the trainer pages"


def test_named_recipe_functions_exist():
    for document in DOCUMENTS:
        for module, name in re.findall(r"megatron_fused_lm\.recipes\.(\w+)\.(\w+)", document.read_text()):
            if name != "py":
                assert hasattr(importlib.import_module(f"megatron_fused_lm.recipes.{module}"), name), (module, name)


def test_configuration_examples_enable_the_fused_head():
    assert {trainer: len(blocks(page.read_text(), "yaml")) for trainer, page in PAGES.items()} == YAML_BLOCKS
    assert not blocks(INDEX.read_text(), "yaml")
    for page in PAGES.values():
        for block in blocks(page.read_text(), "yaml"):
            call = SECTION_COMMENT.match(block)
            assert call, f"the block does not start with the from_trainer_config call its trainer makes:\n{block}"
            config = FusedLMConfig.from_trainer_config(yaml.safe_load(block), section=call.group(1))
            assert config.enabled and config.backend == "auto", (page.name, call.group(1), config)


def test_every_document_names_each_trainer_s_section_as_its_page_does():
    pages = {call for page in PAGES.values() for call in SECTION_COMMENT.findall(page.read_text())}
    named = {
        (path.relative_to(ROOT), section)
        for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").iterdir()]
        for section in re.findall(r'section="([^"]+)"', path.read_text())
    }
    assert named and all(section in pages for _, section in named), sorted(named)


def test_slime_command_line_enables_the_fused_head():
    assert not any(blocks(page.read_text(), "bash") for page in DOCUMENTS if page != PAGES["slime"])
    [block] = blocks(PAGES["slime"].read_text(), "bash")
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["python", "train.py"]
    args, _ = slime.add_fused_lm_arguments(argparse.ArgumentParser()).parse_known_args(words[2:])
    assert FusedLMConfig.from_trainer_config(args) == FusedLMConfig(enabled=True, backend="auto")


def test_slime_has_a_flag_for_every_key():
    # Each trainer key as slime's command line spells it, read back by the config.
    flags = {key: "--" + key.replace("_", "-") for key in TRAINER_KEYS}
    values = {"fused_linear_logprob_backend": "triton", "fused_linear_logprob_token_chunk": "512",
              "fused_linear_logprob_vocab_size": "151665", "fused_linear_logprob_softcap": "30"}  # fmt: skip
    words = [word for key, flag in flags.items() for word in ([flag, values[key]] if key in values else [flag])]
    config = FusedLMConfig.from_trainer_config(
        slime.add_fused_lm_arguments(argparse.ArgumentParser()).parse_args(words)
    )
    assert config == FusedLMConfig(
        enabled=True, backend="triton", token_chunk=512, batch_invariant=True, vocab_size=151665, softcap=30.0
    )


def test_settings_table_names_the_keys_and_defaults():
    rows = re.findall(r"^\| `(fused_linear_logprob\w*)` \| `([^`]+)` \|", INDEX.read_text(), flags=re.M)
    assert [key for key, _ in rows] == list(TRAINER_KEYS), rows
    defaults = {field.name: field.default for field in dataclasses.fields(FusedLMConfig)}
    for key, default in rows:
        assert yaml.safe_load(default) == defaults[TRAINER_KEYS[key]], (key, default)

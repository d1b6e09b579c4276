"""What every CPU test starts from, and the fixtures several test files share.

Every test starts from the same global torch seed, so a test that draws from the global generator
sees the same numbers whichever tests ran before it (pytest's selection and order, the
environment's plugins), and with the package's warn-once memory empty, so a test that expects a
warning gets it whichever tests warned before. (Spawned ranks start from neither:
``devkit.megatron_gpt.RecordedWarnings`` forgets the warnings there.)"""

import logging

import pytest
import torch

from megatron_fused_lm import _logging


@pytest.fixture(autouse=True)
def same_global_seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def no_earlier_warnings():
    _logging._already_warned.clear()


@pytest.fixture
def package_warnings(caplog):
    """A function that lists the package's warning messages logged so far in the test."""
    with caplog.at_level(logging.WARNING, logger="megatron_fused_lm"):
        yield lambda: [record.getMessage() for record in caplog.records if record.name == "megatron_fused_lm"]


# The files whose tests take minutes, longest first: collected ahead of the rest, so that while they
# run pytest-xdist's other workers take the short tests, instead of the long ones ending a run alone.
LONG_FIRST = (
    "test_real_training.py",
    "test_pipeline_layouts.py",
    "test_examples.py",
    "test_triton_interpreter.py",
    "test_integration_provenance.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))

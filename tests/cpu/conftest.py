"""Every CPU test starts from the same global torch seed, so a test that draws from the global
generator sees the same numbers whichever tests ran before it (pytest's selection and order, the
environment's plugins)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def same_global_seed():
    torch.manual_seed(0)

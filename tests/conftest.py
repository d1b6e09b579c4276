"""Test setup: make the shared test helpers in tests/cpu importable from every test folder."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpu"))

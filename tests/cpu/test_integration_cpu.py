"""``megatron_fused_lm.integration.cpu``, the public set-up for trying the head on a CPU, and the
quiet import: each check in a fresh interpreter (process groups and warnings are process-wide), on
every megatron-core release the integration tests run on."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FIRST_USE = """
import os, torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_fused_lm.integration import FusedLMConfig, wrap_model
from megatron_fused_lm.integration.cpu import megatron_on_cpu

for attempt in range(2):  # a second use finds the environment as the first left it
    with megatron_on_cpu() as device:
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   attention_dropout=0.0, hidden_dropout=0.0)
        torch.manual_seed(0)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                         max_sequence_length=16).to(device)
        head = wrap_model(model, FusedLMConfig(enabled=True, backend="torch"))
        tokens = torch.randint(0, 256, (2, 16))
        positions = torch.arange(16).expand(2, 16)
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
        with head.stock_logits():
            logits = model(tokens, positions, mask)
        # float64 from the float32 logits; the op's own float32 error at vocabulary 256 is ~1e-6
        expected = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        got = head.logprobs(model(tokens, positions, mask), tokens.roll(-1, dims=1))[:, :-1]
        assert (got.double() - expected).abs().max() < 1e-5, (got.double() - expected).abs().max()
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    assert not torch.distributed.is_initialized()
print("first use: ok")
"""


def python(code: str, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *options, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_first_use_on_the_cpu_matches_the_stock_logits():
    done = python(FIRST_USE)
    assert done.returncode == 0 and "first use: ok" in done.stdout, done.stderr[-3000:]


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_is_refused():
    code = (
        "from megatron_fused_lm.integration.cpu import megatron_on_cpu\n"
        "try:\n    with megatron_on_cpu(tensor_parallel_size=2): pass\n"
        "except ValueError as error: print(error)\n"
        "import torch.distributed as dist; assert not dist.is_initialized()\n"
    )
    done = python(code)
    assert done.returncode == 0 and "does not divide the 1 processes" in done.stdout, done.stderr[-3000:]


def test_importing_the_integration_prints_no_fallback_warnings_and_filters_nothing_else():
    code = (
        "import warnings\n"
        "import megatron_fused_lm.integration\n"
        "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"  # preloaded: quiet
        "warnings.warn('Apex is not installed. Falling back to Torch Norm', UserWarning)\n"
        "warnings.warn('another warning', UserWarning)\n"
    )
    done = python(code, "-W", "always")
    # Megatron's announcements while the integration imported it are gone; the filter did not
    # outlive the import: the same message raised afterwards, and any other, still show.
    assert done.returncode == 0, done.stderr[-3000:]
    notices = re.findall(r"(?:Transformer Engine and Apex are|Apex is) not installed", done.stderr)
    assert len(notices) == 1 and "another warning" in done.stderr, done.stderr
    assert "absl.logging is not installed" not in done.stderr, done.stderr  # megatron-core 0.17 on

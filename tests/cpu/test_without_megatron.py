"""The ops work without megatron-core; the integration says what to install."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    class NoMegatron:
        # Stands in for an environment without megatron-core installed.
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoMegatron())
    import torch
    import megatron_fused_lm
    from megatron_fused_lm import fused_linear_logprob

    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    expected = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(fused_linear_logprob(hidden, weight, targets), expected, atol=1e-5)
    try:
        megatron_fused_lm.wrap_model
    except ImportError as error:
        print("IMPORT ERROR:", error)
    """
)


def test_ops_import_and_run_without_megatron_and_the_integration_names_the_extra():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORT ERROR:" in done.stdout, done.stdout
    assert "megatron-fused-lm[megatron]" in done.stdout, done.stdout

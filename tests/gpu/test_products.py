"""``products.add_product`` on CUDA accumulates into a float32 ``out`` without rounding what it held:
the backends add each vocabulary chunk's ``dz @ W`` into a float32 hidden-gradient accumulator and
each token chunk's ``dz.T @ h`` into the held float32 weight gradient this way (``accumulate=True``),
so an accumulator rounded to the 16-bit operands' dtype at each step would undo what holding it in
float32 is for. The products here are of zeros: whatever ``out`` holds afterwards is what it held,
or its rounding. On one H100 (2026-12-07) a split product's aligned bulk at depth 32000 with
``beta=1`` erred by about bf16's rounding of the ``out`` it started from (9.3e-6 of the result's
largest entry where cuBLAS's whole product at depth 32003 erred 1.4e-6), which these cases isolate.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fused_lm.ops import products

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HELD = 1 + 2**-12  # float32, not a bf16 value: rounding it to bf16 gives 1


@pytest.mark.parametrize("depth", [32000, 32003, 4096, 3])
@pytest.mark.parametrize("rows", [512, 2048])
@pytest.mark.parametrize("layout", ["row_major", "transposed"])
def test_accumulating_keeps_the_float32_out(depth, rows, layout):
    left = torch.zeros(rows, depth, device="cuda", dtype=torch.bfloat16)
    if layout == "transposed":  # dz.T @ h: the block read transposed
        left = torch.zeros(depth, rows, device="cuda", dtype=torch.bfloat16).t()
    right = torch.zeros(depth, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.full((rows, 256), HELD, device="cuda")
    products.add_product(out, left, right, accumulate=True)
    assert torch.equal(out, torch.full_like(out, HELD)), float((out - HELD).abs().max())

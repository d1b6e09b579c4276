"""The three-GEMM pass of ``fused_linear_loss`` and ``fused_linear_cross_entropy``: a loss known in
the forward gets its gradients there. It reads top to bottom in four modules and the backends':

1. ``held``: ``run_held_pass`` (the forward), ``HeldGradients`` and ``finish`` (the backward);
2. ``chunks``: the chunk loop (``run_loss_pass``), the route's phases (``phases_for``), the
   per-chunk loss (``ChunkLoss``) and the contract of a per-token ``loss_fn``;
3. ``compiled``: the phases as custom operators, for a compiled graph;
4. ``weight_grad``: where the weight gradient goes, its float32 parts, and the ledger of what a
   loss leaves in ``weight_grad_into``;
5. the backends' phases: ``backends.contract``, ``backends.torch_loss``, ``backends.triton_loss``.

Nothing is imported here: the backends import ``weight_grad`` without loading the pass.
"""

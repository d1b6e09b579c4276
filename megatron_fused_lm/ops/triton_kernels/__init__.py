"""Triton kernels of the Triton backend, one file per kernel.

Each file holds one ``@triton.jit`` kernel and the function that launches it on torch tensors.
``tiles.Tiles`` carries the launch shape that ``triton_backend`` chooses per problem.
"""

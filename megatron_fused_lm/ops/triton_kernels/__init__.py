"""Triton kernels of the Triton backend, one file per kernel.

Each kernel file holds one ``@triton.jit`` kernel and the function that launches it on torch
tensors. ``tiles.Tiles`` carries the launch shape that ``triton_backend`` chooses per problem;
``descriptors`` makes the tensor descriptors (TMA) through which both kernels read and write.
"""

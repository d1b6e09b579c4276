"""The Triton kernels, one file per kernel: each holds one ``@triton.jit`` kernel and the function
that launches it on torch tensors. ``tiles.Tiles`` is a launch shape, ``descriptors`` makes the
tensor descriptors (TMA) the matrix kernels read and write through, and ``epilogue`` holds the
Triton functions the kernels share."""

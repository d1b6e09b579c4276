"""The implementations behind ``backend=``: the torch backend (``torch_recompute``, ``torch_loss``),
chunked PyTorch code on any device; ``triton.TritonBackend``, the Triton kernels on CUDA; and
``cute.CuteBackend``, Triton's with the forward statistics of a CuTe DSL kernel on Hopper. What a
backend receives, returns and must have is ``contract``'s (``contract.Backend``); ``registry``
resolves a call's backend once and names it in the options. Nothing is imported here, so that the
ops reach the contract without loading a backend."""

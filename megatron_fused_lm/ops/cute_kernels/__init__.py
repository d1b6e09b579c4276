"""The CuTe DSL kernels (Hopper, sm90a), imported only where the ``cute`` backend runs: they need
``nvidia-cutlass-dsl`` (the ``cute`` extra), which the rest of the package never imports."""

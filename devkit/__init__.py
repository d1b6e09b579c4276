"""Support code shared by the tests, the benchmarks and the multi-GPU scripts (not shipped with the
package): the float64 oracle and error measures, process spawning, allocation recording, Megatron
GPTModel builders and measurement helpers. Importable from the repository root (pytest's
``pythonpath`` setting, or ``PYTHONPATH=.`` for scripts)."""

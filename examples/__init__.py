"""Runnable examples of megatron-fused-lm, and the trainer recipes of docs/INTEGRATIONS.md."""

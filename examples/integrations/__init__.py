"""The recipes of ``docs/INTEGRATIONS.md``: the code a user of SkyRL, verl, slime or NeMo-RL adds to
their trainer to switch the fused LM head on, one module per trainer. Each module imports only torch,
megatron-core and ``megatron_fused_lm`` (never the trainer), so the CPU tests run every recipe against
a real GPTModel with inputs shaped as that trainer shapes them; the document shows this code verbatim."""

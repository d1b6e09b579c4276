"""Trainer recipes: the code a user of SkyRL, verl, slime or NeMo-RL adds to their trainer to switch
the fused LM head on, one module per trainer (``megatron_fused_lm.recipes.skyrl`` and so on). Each
imports only torch, megatron-core and ``megatron_fused_lm``, never the trainer, so that the CPU tests
run every recipe against a real GPTModel with inputs shaped as that trainer shapes them. Importing
this package imports none of them."""

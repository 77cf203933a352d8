"""The reference system's ``ktransformers.models.modeling_*`` module paths, as thin aliases of
the transformers 5 classes, so rule files written for it (``class:
ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE``) load unchanged.  No modeling code
is copied: every name here *is* the transformers class."""

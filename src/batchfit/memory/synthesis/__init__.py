"""Traces written rather than traced: a deep model from a cut one, other batch sizes, accumulation, FSDP.

``stacks``/``stackplan`` find a model's repeated blocks and cut them, ``sweeps``/``blocklabels`` read the
cut trace, ``depth``/``fulldepth`` write the full depth; ``scaling`` predicts any batch size from two,
``accumulation`` a second micro-batch, ``sharding`` one FSDP rank.
"""

"""The planning stage: from a workload and a device to a micro-batch, a split and a ranked plan.

``fit`` finds the largest micro-batch (``search`` holds its doubling-and-bisecting search) or, with
``maximize="seq_len"``, the longest sequence at a batch (``seqlen``), against a budget from ``budget``;
``plan`` splits a global batch into micro-batch x accumulation x GPUs, walking the remedies of
``ladder`` and fitting each rung with ``options`` (side by side in worker processes, ``workers``), ranked by the time
model of ``cost`` and explained by ``messages``; ``sweep`` measures throughput on this machine.
Everything here reads traces through ``batchfit.memory``; nothing here traces on its own.
"""

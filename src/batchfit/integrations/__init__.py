"""Adapters for the frameworks people already train with: Hugging Face ``Trainer``, Lightning, Accelerate.

Each adapter is thin: it turns the framework's objects (a model and ``TrainingArguments``, a
``LightningModule`` and its dataloader, a training function) into a ``Workload``, asks ``plan`` / ``fit``
for the split of the global batch, and turns the ``Plan`` back into the framework's own knobs
(``per_device_train_batch_size`` and ``gradient_accumulation_steps``, ``batch_size`` and
``accumulate_grad_batches``, ``train(micro_batch_size, accumulation_steps)``). No estimation logic
lives here.

Import the one you use; each imports its framework when it is imported, and nothing else in batchfit
imports them:

- ``batchfit.integrations.transformers``: ``plan_training_arguments``, ``BatchfitCallback``
  (``pip install 'batchfit[transformers]'``);
- ``batchfit.integrations.lightning``: ``BatchfitTuner`` (``pip install 'batchfit[lightning]'``);
- ``batchfit.integrations.accelerate``: ``find_executable_batch_size``
  (``pip install 'batchfit[accelerate]'``).
"""

"""Self-supervised training of the feature network (``regkit train-features``), imported on demand (nothing here is
imported with :mod:`regkit.features`).

Modules: :mod:`~regkit.features.training.recipe` (the training recipe's schema, and the shipped recipes
``features-2d.yaml`` and ``features-3d.yaml`` in this folder), :mod:`~regkit.features.training.synth` (the view pairs
synthesised from brain label maps) and :mod:`~regkit.features.training.train` (the loss, the trainer and its
checkpoints).
"""

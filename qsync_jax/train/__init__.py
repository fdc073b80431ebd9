"""Training: the last stage of the data flow, and the step the predictor times.

This subpackage owns what runs once the plans are chosen. Read it in this
order:

* :mod:`.losses` and :mod:`.loss_scale`: the loss and the dynamic loss scale
  of FP16 layers;
* :mod:`.step`: the one training step (one jitted gradient function per
  plan, every local worker's gradients, the optimizer update);
* :mod:`.layout`: how per-worker state is stacked over the ``workers`` mesh
  axis;
* :mod:`.programs`: the shard_map programs where the workers meet (averaged
  update, local update, parameter averaging, means for evaluation);
* :mod:`.evaluation`: FP32 evaluation of the workers' mean model;
* :mod:`.executable_cache`: the per-device programs of processes other
  than 0, kept across restarts (jax's persistent cache keeps process 0's);
* :mod:`.state`: :class:`~qsync_jax.train.state.TrainState`, everything a
  step changes, as one pytree; :mod:`.sync`: the synchronization settings;
* :mod:`.trainer`: :class:`~qsync_jax.train.trainer.HybridTrainer`, which
  builds the programs and runs a step as a pure function of the state;
  :mod:`.checkpoint` saves and restores the state (:mod:`.resharding` onto
  other workers).

Nothing is re-exported here: the predictor imports :mod:`.step` and
:mod:`.programs`, and importing this package must not load the trainer. The
trainer's public names are exported by :mod:`qsync_jax` itself.
"""

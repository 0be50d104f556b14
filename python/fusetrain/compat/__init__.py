"""Bridges from other training libraries' configurations to fusetrain's.

* :mod:`fusetrain.compat.super_gradients`: SuperGradients' training
  hyperparameters (a recipe's ``training_hyperparams`` YAML or the dict its
  Hydra resolves) translated into ``training_params``, with a report of every
  key.
"""

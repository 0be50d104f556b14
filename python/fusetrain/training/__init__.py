"""Training: the Trainer and its ``training_params``."""

from .params import TRAINING_PARAMS, ParamSpec, TrainingParams, TrainingParamsError, resolve_training_params
from .step.train_step import TrainStep

"""Callbacks that a recipe run in a child process names by class path
(``training_params.callbacks=[_preemption_helpers.Name]``, this folder on
PYTHONPATH); they take their settings from the environment, as a class path
gives no arguments.

* ``SignalAtStep``: global rank 0 sends itself ``FUSETRAIN_TEST_SIGNAL`` (default
  SIGUSR1) at the end of optimizer step ``FUSETRAIN_TEST_SIGNAL_STEP``.
* ``KillOnce``: rank ``FUSETRAIN_TEST_KILL_RANK`` kills itself with SIGKILL at
  the end of step ``FUSETRAIN_TEST_KILL_STEP``, in torchrun's first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` 0).
* ``SlowSteps``: sleeps ``FUSETRAIN_TEST_STEP_SLEEP`` seconds after each step.
"""

import os
import signal
import time

from fusetrain import Callback


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SignalAtStep(Callback):
    def __init__(self):
        self.step = int(os.environ["FUSETRAIN_TEST_SIGNAL_STEP"])
        self.signal = signal.Signals[os.environ.get("FUSETRAIN_TEST_SIGNAL", "SIGUSR1")]

    def on_step_end(self, state):
        if state.global_step == self.step and _rank() == 0:
            os.kill(os.getpid(), self.signal)


class KillOnce(Callback):
    def __init__(self):
        self.rank = int(os.environ["FUSETRAIN_TEST_KILL_RANK"])
        self.step = int(os.environ["FUSETRAIN_TEST_KILL_STEP"])

    def on_step_end(self, state):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and state.global_step == self.step and _rank() == self.rank:
            print(f"rank {self.rank}: SIGKILL at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class SlowSteps(Callback):
    def __init__(self):
        self.seconds = float(os.environ.get("FUSETRAIN_TEST_STEP_SLEEP", "0.05"))

    def on_step_end(self, state):
        time.sleep(self.seconds)

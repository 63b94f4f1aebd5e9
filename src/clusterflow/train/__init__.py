"""The training loop users touch: ``fit``, ``TrainingSession`` and hooks.

Keras users call :func:`fit` under a strategy scope; users of their own PyTorch loop
wrap it in a :class:`TrainingSession` (TensorFlow's ``MonitoredTrainingSession``), which
restores, saves on schedule, stops and closes cleanly. Hooks plug into both:
:class:`StopAtStep`, :class:`Checkpoint`, :class:`Summary`, :class:`Progress` and, for
the evaluator task, :class:`Evaluate` / :func:`run_evaluator`. :func:`report` sends the
live figures that ``clusterflow ps`` shows.
"""

from __future__ import annotations

from clusterflow.train.api import Hook, StepInfo, TrainConfigError, TrainError
from clusterflow.train.checkpoint import Checkpoint
from clusterflow.train.evaluate import Evaluate, Evaluation, is_evaluator, run_evaluator
from clusterflow.train.fit import fit
from clusterflow.train.history import History
from clusterflow.train.metrics import accuracy
from clusterflow.train.progress import Progress
from clusterflow.train.report import report
from clusterflow.train.session import TrainingSession
from clusterflow.train.stop import StopAtStep
from clusterflow.train.summary import Summary

__all__ = [
    "Checkpoint",
    "Evaluate",
    "Evaluation",
    "History",
    "Hook",
    "Progress",
    "StepInfo",
    "StopAtStep",
    "Summary",
    "TrainConfigError",
    "TrainError",
    "TrainingSession",
    "accuracy",
    "fit",
    "is_evaluator",
    "report",
    "run_evaluator",
]

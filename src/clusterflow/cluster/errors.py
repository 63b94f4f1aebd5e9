"""Errors raised by the cluster model.

Each derives from :class:`~clusterflow.errors.ConfigError` (and so from ``ValueError``,
which is what TensorFlow raises for the same mistakes), so callers that already catch
``ValueError`` around ``tf.train.ClusterSpec`` keep working. Every message names the
offending value, because these errors surface far from where the value was typed (a
``TF_CONFIG`` set by a launcher, a spec file on another machine).
"""

from __future__ import annotations

from clusterflow.errors import ConfigError

__all__ = ["ClusterSpecError", "DeviceSpecError", "TFConfigError"]


class ClusterSpecError(ConfigError):
    """A cluster spec, task id or address is malformed, or names a task it lacks."""


class TFConfigError(ConfigError):
    """A ``TF_CONFIG`` document is not valid JSON or not TensorFlow's format."""


class DeviceSpecError(ConfigError):
    """A device string such as ``/job:ps/task:0/device:CPU:0`` is malformed."""

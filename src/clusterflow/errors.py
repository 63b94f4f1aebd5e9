"""The root of clusterflow's error hierarchy.

A leaf module: it imports nothing of ours, so every layer (``cluster`` included) may
raise these without breaking the one-way import rule of docs/architecture.md section 2.
"""

from __future__ import annotations


class ClusterflowError(Exception):
    """Every error that clusterflow raises on purpose derives from this."""


class ConfigError(ClusterflowError, ValueError):
    """A value given by the user (spec, flag, file) is invalid; the message names it."""

"""The one error a checkpoint's problems raise (core/model_config.py re-exports it), in a module
of its own so that the family readers (core/family_fields.py) and the config share it."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message names file and field."""

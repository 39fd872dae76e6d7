"""The one error type of config.json parsing (kept apart so config and config_v41 share it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config.json value is missing or outside what the model graph supports."""

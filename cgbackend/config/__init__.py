"""cgbackend's options: the frozen :class:`Config` (options.py, the only reader of ``CGBACKEND_*``),
the documentation generated from its field docstrings (docs.py) and "did you mean" for a mistyped
name or value (suggest.py)."""

from .options import BOOL_OR_PATH, DEFAULT_CAPTURE_SIZES, ENV_PREFIX, Config, ConfigError, parse_value

__all__ = ["BOOL_OR_PATH", "DEFAULT_CAPTURE_SIZES", "ENV_PREFIX", "Config", "ConfigError", "parse_value"]

"""cgbackend's options: the frozen :class:`Config` (options.py, the only reader of ``CGBACKEND_*``),
the ``static_dispatch`` option's typed value (dispatch_mode.py), the documentation generated from
the field docstrings (docs.py) and "did you mean" for a mistyped name or value (suggest.py)."""

from .dispatch_mode import DispatchMode
from .options import BOOL_OR_PATH, DEFAULT_CAPTURE_SIZES, ENV_PREFIX, Config, ConfigError, parse_value

__all__ = ["BOOL_OR_PATH", "DEFAULT_CAPTURE_SIZES", "DispatchMode", "ENV_PREFIX", "Config", "ConfigError",
           "parse_value"]

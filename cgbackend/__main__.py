"""``python -m cgbackend explain ...`` and ``python -m cgbackend bench ...``."""

from .cli import main

raise SystemExit(main(prog="python -m cgbackend"))

"""The one place the version is written: the package (cgbackend.__version__), the wheel's metadata
(pyproject.toml reads it as ``attr``) and ``python -m cgbackend --version`` all read it here."""

__version__ = "0.1.0"

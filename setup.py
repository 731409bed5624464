"""Only the long description: the README with its relative links made absolute, so they work
wherever the description is shown (PyPI, `pip show`). Everything else is in pyproject.toml."""

import os
import re

from setuptools import setup

REPOSITORY = "https://github.com/cgbackend/cgbackend"  # as [project.urls] in pyproject.toml


def long_description() -> str:
    if not os.path.exists("README.md"):
        return ""
    with open("README.md", encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"\]\((?!https?://|#)([^)]+)\)", lambda m: f"]({REPOSITORY}/blob/main/{m.group(1)})", text)


setup(long_description=long_description(), long_description_content_type="text/markdown")

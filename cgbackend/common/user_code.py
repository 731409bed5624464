"""The user's code as cgbackend sees it: which files are the user's, the innermost user frame of
a call, and warnings that name it.

A warning raised with a fixed ``stacklevel`` names whatever frame sits that many levels up: from
inside a compiled call that is a torch or cgbackend file (Dynamo's frames, the runtime's), never
the line the user wrote. :func:`warn` walks out of those frames first, so the warning points at the
user's call; where no user frame is on the stack (a hook that autograd runs on its own thread) it
names ``fallback``, a line of the user's model, if the caller has one.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import types
import warnings
from typing import Optional

import torch

__all__ = ["is_user_file", "user_frame", "frame_source", "warn"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cgbackend/


def _folder(path: str) -> str:
    return os.path.normcase(os.path.abspath(path)) + os.sep


_MODELS = _folder(os.path.join(_PACKAGE, "models"))
"""cgbackend's reference models (the demo's): a user's models as far as messages go."""
_LIBRARIES = (_folder(os.path.dirname(torch.__file__)), _folder(_PACKAGE))
_INSTALLED = tuple({_folder(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})
"""Installed packages (inside the standard library's folder in many layouts): a model from
transformers is a user's model."""
_STDLIB = _folder(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4096)  # per frame of every op the launch counter sees outside regions
def is_user_file(filename: str) -> bool:
    """Not a file of torch, cgbackend (its reference models excepted) or the standard library, nor
    generated code (``<eval_with_key>.N``, ``<frozen ...>``)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    if path.startswith(_MODELS):
        return True
    if path.startswith(_LIBRARIES):
        return False
    return path.startswith(_INSTALLED) or not path.startswith(_STDLIB)


def user_frame(frame: Optional[types.FrameType]) -> tuple[Optional[types.FrameType], int]:
    """The innermost frame at or above ``frame`` that is the user's, and how many frames up it is
    (0: ``frame`` itself); ``(None, n)`` when every frame is torch's or cgbackend's."""
    up = 0
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
        up += 1
    return frame, up


def _function_name(name: str) -> str:
    """The user's function behind Dynamo's resume functions (``torch_dynamo_resume_in_f_at_12``)."""
    prefix = "torch_dynamo_resume_in_"
    if name.startswith(prefix) and "_at_" in name:
        return name[len(prefix):].rsplit("_at_", 1)[0]
    return name


def frame_source(frame: types.FrameType) -> tuple[str, str]:
    """``("file.py:LINE in function", the line's code)`` of ``frame``."""
    filename = frame.f_code.co_filename
    base = filename.replace("\\", "/").rsplit("/", 1)[-1]
    code = linecache.getline(filename, frame.f_lineno).strip()
    return f"{base}:{frame.f_lineno} in {_function_name(frame.f_code.co_name)}", code


def warn(message: str, category: type[Warning], fallback: Optional[tuple[str, int]] = None) -> None:
    """``warnings.warn(message, category)`` naming the user's frame that led to this call; without
    one, ``fallback`` (a file and line of the user's model), else the caller's own frame."""
    caller = sys._getframe(1)
    frame, up = user_frame(caller)
    if frame is not None:
        warnings.warn(message, category, stacklevel=2 + up)
    elif fallback is not None and fallback[0]:
        filename, line = fallback
        module = os.path.splitext(os.path.basename(filename))[0]
        warnings.warn_explicit(message, category, filename, line, module=module)
    else:
        warnings.warn(message, category, stacklevel=2)

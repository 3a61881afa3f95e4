"""Relative paths inside a step directory: the one check every path taken from a slot, a manifest or a
marker passes before it touches the file system (promise 9).

A path is accepted only if it is relative, made of plain components (no empty, ``.`` or ``..``
component, no NUL or backslash) and, once joined to its step directory, still lies inside it with
symlinks resolved. Anything else is refused with the reason: the path may have been written by
someone else.
"""
from __future__ import annotations

import os

from easyckpt.errors import UnsafePath

MAX_RELPATH = 1024


def check_relpath(rel: object) -> str:
    """``rel`` if it is a safe relative path (string checks only); UnsafePath otherwise."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePath(f"file name {rel!r} is not a non-empty string")
    if len(rel) > MAX_RELPATH or "\0" in rel or "\\" in rel:
        raise UnsafePath(f"file name {rel[:80]!r} is too long or holds a NUL or backslash")
    if rel.startswith("/"):
        raise UnsafePath(f"file name {rel!r} is absolute")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"file name {rel!r} has an empty, '.' or '..' component")
    return rel


def inside(base: str, rel: object) -> str:
    """The path of ``rel`` inside directory ``base``, refused if it leaves ``base`` (symlinks resolved)."""
    path = os.path.join(base, check_relpath(rel))
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if os.path.commonpath([real_base, real]) != real_base or real == real_base:
        raise UnsafePath(f"file name {rel!r} resolves to {real}, outside the step directory {base}")
    return path

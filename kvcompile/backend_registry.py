"""The ``kvcompile.backend()`` objects alive in this process: :class:`kvcompile.compile_backend.KVCompileBackend`
registers each one when it is made (:func:`register`), and the cache asks :func:`unused_backend_exists`
(a decode step written eagerly while a backend that has compiled nothing exists). Imports nothing of
kvcompile, so the cache does not import the compiler to ask."""

from __future__ import annotations

import weakref

__all__ = ["register", "unused_backend_exists"]

# every backend made in this process that is still alive; a backend's ``used`` turns True when
# Dynamo hands it a graph
_BACKENDS: "weakref.WeakSet" = weakref.WeakSet()


def register(backend) -> None:
    """Count ``backend`` (an object with a ``used`` attribute) among this process's live backends."""
    _BACKENDS.add(backend)


def unused_backend_exists() -> bool:
    """Whether some live backend of this process has not been handed a graph yet."""
    return any(not b.used for b in _BACKENDS)

"""Backends, launch cache and autotune cache: what every op's wrapper launches through."""
from .backends import Backend, backend
from .launch import LaunchCache, kernel

__all__ = ["Backend", "backend", "LaunchCache", "kernel"]

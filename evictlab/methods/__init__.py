"""Eviction methods: scorers and allocators, each a small dataclass in a registry.

Add a scorer: write a dataclass subclassing :class:`Scorer` with ``name`` (and ``needs``
or ``uses_all_queries`` where it needs them) and ``score(inputs)`` in ``scorers.py`` and
add one line to :data:`REGISTRY`. Add an allocator: write a frozen
dataclass subclassing :class:`Allocator` with ``name`` and ``allocate(inputs)`` in
``allocators.py`` and add one line to :data:`ALLOCATORS`. :func:`build_method` builds a method text
(``SCORER[+ALLOCATOR]`` and parameters) into a :class:`Method` once, for the decode loop.
See ``docs/methods.md``.
"""

from __future__ import annotations

from evictlab.methods.base import (
    AllocationError,
    AllocInputs,
    Allocator,
    Scorer,
    ScoreInputs,
    WindowProfile,
    check_sizes,
    select_keep,
)
from evictlab.methods.method import Method, build_method
from evictlab.methods.params import parse_assignments
from evictlab.methods.registry import (
    ALLOCATORS,
    REGISTRY,
    MethodText,
    canonical_method,
    make_allocator,
    make_scorer,
    parse_method,
    parse_method_text,
)

__all__ = [
    "ALLOCATORS",
    "REGISTRY",
    "AllocInputs",
    "AllocationError",
    "Allocator",
    "Method",
    "MethodText",
    "ScoreInputs",
    "Scorer",
    "WindowProfile",
    "build_method",
    "canonical_method",
    "check_sizes",
    "make_allocator",
    "make_scorer",
    "parse_assignments",
    "parse_method",
    "parse_method_text",
    "select_keep",
]

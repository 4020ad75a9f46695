"""Compiling a test module's kernel variants ahead, side by side.

A parametrized kernel test loads a library per variant, and on an empty kernel cache (a CI run)
each load compiles, one after the other, while the second core waits. A module fixture hands the
variants' builds to `built_side_by_side` first: they compile a core each, and the tests then find
them in the cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor


def built_side_by_side(builds: Iterable[Callable[[], object]]) -> None:
    """Runs each build, as many at once as there are CPUs; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for _ in pool.map(lambda build: build(), builds):
            pass

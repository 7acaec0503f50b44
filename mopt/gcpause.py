"""Pausing Python's cyclic garbage collector around the front end's allocation bursts.

Loading a 10,000-node recipe, building its graph and keying it allocates a few million
objects that all stay alive. Each allocation burst triggers full collections that scan the
whole (growing) heap and find nothing to free: about 1 s of a 10,000-node `mopt plan`.
Reference counting still frees everything that is not in a cycle while the collector is
paused, and it is turned back on (never left off) when the block ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc(*, freeze: bool = False) -> Iterator[None]:
    """Run the block with the cyclic collector off; with `freeze`, what is alive at the end
    (the recipe, the graph: alive until the process exits) is moved out of the collector's
    sight (`gc.freeze`), so later collections do not scan it again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if freeze:
                gc.freeze()
            gc.enable()

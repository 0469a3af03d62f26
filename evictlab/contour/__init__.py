"""ContourKV's statistics: dropped-mass profiles per cell, fitted from rows or measured online.

The data flow is capture -> rows -> solve -> stats -> **contour** -> decode: this package
turns attention rows into per-cell dropped-mass profiles; the allocator that spends a
budget along them is :class:`evictlab.methods.contour.ContourKV` (``SCORER+contourkv``).

* :mod:`evictlab.contour.profile` -- the statistic (:func:`tail_mass`), its online estimate
  from the observation window (:func:`window_stats`) and the versioned profile file
  (:class:`ContourProfile`);
* :mod:`evictlab.contour.level` -- the exact level search (a Numba k-way merge, with a
  plain-numpy reference);
* :mod:`evictlab.contour.fit` -- profiles from a row dataset (``evictlab contour fit``).

Definitions: ``docs/theory.md`` (ContourKV, ours) and ``docs/methods.md``.
"""

from __future__ import annotations

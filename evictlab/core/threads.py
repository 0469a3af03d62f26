"""Threads of the kernels: one BLAS thread inside parallel Numba loops, one Numba thread for small batches.
"""

from __future__ import annotations

import numba

#: Below this many multiply-adds a batch runs on one thread: forking the thread pool costs
#: more than it saves (and on an oversubscribed machine far more; docs/performance.md).
PARALLEL_MIN_WORK = 2_000_000


def single_blas_thread():
    """Context manager limiting BLAS / LAPACK (OpenBLAS, MKL) to one thread.

    Use it around Numba kernels that call LAPACK inside ``prange`` (the SVD least squares of
    the exact free-weight phase, the SVD of the solve certificate): otherwise every Numba
    thread starts its own BLAS thread pool, the cores are oversubscribed and spin-waiting
    BLAS threads cost more than the work (measured 15x slower). Shared by
    :mod:`evictlab.core` and :mod:`evictlab.solve`.
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)


def run_kernel(kernel, work: float, *args, lapack: bool = False):
    """Run a parallel kernel, on one thread when ``work`` (multiply-adds) is small.

    ``lapack=True``: the kernel calls LAPACK inside its parallel loop, so BLAS is limited to
    one thread while it runs multi-threaded (:func:`single_blas_thread`).
    """
    threads = numba.get_num_threads()
    if work >= PARALLEL_MIN_WORK or threads == 1:
        if lapack and threads > 1:
            with single_blas_thread():
                return kernel(*args)
        return kernel(*args)
    numba.set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(threads)

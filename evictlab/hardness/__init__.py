"""NP-hardness of zero-error forced-weight eviction (ZERO-ES): reduction, exact deciders, checker.

* :mod:`~evictlab.hardness.instances`  the two problems, validation, JSON, exact certificate checks
* :mod:`~evictlab.hardness.reduction`  k-subset-sum -> ZERO-ES and the certificate maps both ways
* :mod:`~evictlab.hardness.deciders`   CP-SAT, the (count, sum) DP, and enumeration
* :mod:`~evictlab.hardness.generators` planted yes, proved no, adversarial families
* :mod:`~evictlab.hardness.check`      the checker behind ``evictlab hardness check``
"""

from evictlab.hardness.deciders import Decision, decide_image, decide_source
from evictlab.hardness.instances import CPSAT_LIMIT, KSubsetSum, ZeroES, check_cpsat_limits, load_instance
from evictlab.hardness.reduction import (
    image_bit_bound,
    image_to_source_certificate,
    reduce_instance,
    source_to_image_certificate,
)

__all__ = [
    "CPSAT_LIMIT", "Decision", "KSubsetSum", "ZeroES", "check_cpsat_limits", "decide_image",
    "decide_source", "image_bit_bound", "image_to_source_certificate", "load_instance",
    "reduce_instance", "source_to_image_certificate",
]

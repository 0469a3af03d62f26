"""Claim (beyond the paper): how often the candidate pool misses the true optimum ES(s).

Reads the certification pass only (short rows, n <= 48, solved with `evictlab solve
--certify`; default: the `certified` entry of the latest `make demo` run's inputs.json), and
writes the fraction of rows whose certified optimum over all keys is strictly below the
pool optimum ES_hat(s), per (model, s), with prompt-clustered bootstrap CIs.

    .venv/bin/python paper_repro/claim_certified_pool.py [--run runs/demo | --results CERTIFIED.parquet ...]
"""

from __future__ import annotations


import _common

from evictlab.errors import InputError
from evictlab.record import RunRecord
from evictlab.stats.ceilings import summarize
from evictlab.stats.claims import certified


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    record = RunRecord(kind="paper-repro-certified", seed=args.seed, config=_common.config(args))
    df = _common.results(args, kind="certified")
    if "es_cert" not in df.columns:
        raise InputError("--results", "these results have no es_cert column", "pass results solved with `evictlab solve --certify`")
    summary = summarize(df, ("model", "s"), seed=args.seed, n_boot=args.n_boot, threshold=args.threshold)
    _common.publish(args, "claim_certified_pool.py", certified(summary, args.weights), [], record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)

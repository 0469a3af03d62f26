"""The training curves of retention gates (docs/gates.md): loss terms and retained mass by step."""

from __future__ import annotations

import os
from typing import Any

from evictlab.plots.common import Figure, require, save, setup

__all__ = ["gates_training"]


def gates_training(losses: Any, validation: list[dict[str, float]], out: str | os.PathLike[str],
                   title: str = "") -> Figure:
    """Three panels over the optimizer step: the KL to the teacher (nats; training batches and
    the validation set), the cross-entropy (nats), and the retained mass ``max_t S_t /
    M_global`` (1 = the budget; the 5% band shaded) with the adapted capacity weight on a
    second axis.

    ``losses``: a polars DataFrame with one row per step (``losses.parquet``: ``step``,
    ``kl``, ``ce``, ``retained_mean``, ``capacity_weight``); ``validation``: the rows of
    ``gates.json``'s ``validation`` (``step``, ``kl``, ``ce``, ``retained_mean``), possibly
    empty. Writes ``out.png`` and ``out.pdf``.
    """
    require(losses, ["step", "kl", "ce", "retained_mean", "capacity_weight"], "losses")
    plt = setup()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    step = losses["step"].to_numpy() + 1  # the state after that many steps
    vs = [v["step"] for v in validation]
    for ax, key, label in ((axes[0], "kl", "KL(teacher || student), nats"), (axes[1], "ce", "cross-entropy, nats")):
        ax.plot(step, losses[key].to_numpy(), lw=0.9, alpha=0.6, label="training batch")
        if validation:
            ax.plot(vs, [v[key] for v in validation], "o-", lw=1.6, label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax = axes[2]
    ax.axhspan(0.95, 1.05, color="0.85", label="budget +- 5%")
    ax.plot(step, losses["retained_mean"].to_numpy(), lw=0.9, label="training batch")
    if validation:
        ax.plot(vs, [v["retained_mean"] for v in validation], "o-", lw=1.6, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("retained mass max_t S_t / M_global")
    ax.legend(fontsize=8, loc="upper left")
    twin = ax.twinx()
    twin.plot(step, losses["capacity_weight"].to_numpy(), color="tab:red", lw=0.8, ls="--")
    twin.set_yscale("log")
    twin.set_ylabel("capacity weight lambda (dashed)", color="tab:red")
    twin.grid(False)
    if title:
        fig.suptitle(title, fontsize=10)
    caption = ("Training curves of the retention gates: KL to the frozen model and cross-entropy (nats) per step "
               "(thin: that step's batch; dots: the fixed validation sequences), and the retained mass "
               "max_t S_t / M_global (1 = the global budget; grey: within 5%) with the adapted capacity weight.")
    return save(fig, out, caption)

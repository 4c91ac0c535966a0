"""Config checks of the off-policy token masks (rejection, IcePop, KPop, M2PO) an RL experiment composes.

Each mask compares pi_prox with pi_behav (docs/algorithms.md): :func:`masks` refuses a setting where both are the same
tensor (the mask would keep every token and do nothing) and a rejection that rewrites the behaviour weight under an
objective that applies none. The config is read by field name: ``prox``, ``objective`` (with ``decoupled``),
``rejection``, ``icepop``, ``kpop``, ``m2po``.
"""

from __future__ import annotations

from typing import Any

MASK_FIELDS = ("m2po", "rejection", "icepop", "kpop")
"""The config fields of the off-policy masks, in the order the loss applies them."""


def masks_on(cfg: Any) -> tuple[str, ...]:
    """The flag groups (``--rejection.*``) of the masks that are on."""
    return tuple(f"--{f}.*" for f in MASK_FIELDS if getattr(cfg, f, None) is not None)


def masks(cfg: Any) -> None:
    """Refuse a mask of a tensor with itself, and a weight-changing rejection without a behaviour weight."""
    rejection = getattr(cfg, "rejection", None)
    decoupled = cfg.objective.decoupled
    if rejection is not None and rejection.carries_weight and not decoupled:
        raise ValueError(
            f"rejection (action={rejection.action!r}, level={rejection.level!r}) changes the behaviour "
            "weight (a TIS clamp or the sequence geometric mean) and needs an objective that applies a behaviour "
            "weight (a decoupled objective); with a coupled one (--objective.no-decoupled) only a mask can act: use "
            "--rejection.action mask --rejection.level token (or a KL --rejection.metric)"
        )
    on = ", ".join(masks_on(cfg))
    if not on:
        return
    if cfg.prox == "behav":
        raise ValueError(
            f"--prox behav makes pi_prox the behaviour log-probs, so the off-policy mask(s) {on} would compare "
            "pi_behav with itself and keep every token (the mask does nothing); use --prox recompute (or "
            "--prox interpolate), or turn the masks off with --no-off-policy-masks"
        )
    if cfg.prox == "recompute" and not decoupled:
        raise ValueError(
            "--objective.no-decoupled with --prox recompute takes pi_old = pi_prox = the recomputed log-probs "
            f"(docs/algorithms.md), so the off-policy mask(s) {on} would compare that tensor with itself and keep "
            "every token (the mask does nothing); use a decoupled objective (--objective.decoupled), --prox "
            "interpolate, or turn the masks off with --no-off-policy-masks"
        )


__all__ = ["MASK_FIELDS", "masks_on", "masks"]

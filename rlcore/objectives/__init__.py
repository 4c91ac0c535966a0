"""rlcore.objectives: pure loss functions and off-policy keep-masks over padded ``(b t)`` tensors.

Token objectives share one signature (house style rule 2) and can stand in for each other::

    loss(logp, logp_prox, logp_behav, adv, mask, *, cfg, denom=None, **unused) -> (loss, metrics)

Keep-masks share one signature too: ``keep_mask(logp_prox, logp_behav, mask, *, cfg) -> (keep, weight, metrics)``
(IcePop, KPop, M2PO, rejection). ``weight (b t)`` is the factor the mask puts on the objective's own behaviour
weight: 1 for pure masks (IcePop, KPop, M2PO, token-level rejection masks), the TIS clamp / sequence geometric-mean
factor for ``rejection`` configs with ``carries_weight``. ``rejection.process`` returns the processed behaviour
weight itself (pass it as ``weight=`` to ``ppo.loss``, ``gspo.loss`` or ``cispo.loss``). An experiment composes
them in its own ``loss_fn`` with plain Python and hands that function to ``rlcore.training.step.train_step``.
Formulas, knobs and AReaL deviations: docs/algorithms.md.

``OBJECTIVES[name] -> (ConfigClass, loss_fn)`` and ``MASKS[name] -> (ConfigClass, keep_mask)`` are kept as a
convenience for notebooks and tests that sweep over every objective or mask (plain dicts, editable). Nothing in
the runtime (``rlcore.training``, ``rlcore.rollout``, ``rlcore.inference``) reads them: registering a name changes
no training run; passing the function in a ``loss_fn`` does.

Non-token objectives (their own signatures, see docs/advantages.md): ``kl.estimate``/``kl.penalty``,
``entropy.from_logits``/``entropy.masked_mean``, ``value.loss`` (clipped critic), ``dpo.loss``,
``reward_model.loss``, ``sft.loss``, ``distill.loss``.
"""

from collections.abc import Callable

from rlcore.objectives import cispo, gspo, icepop, kpop, m2po, ppo, rejection, sapo

OBJECTIVES: dict[str, tuple[type, Callable]] = {
    "ppo": (ppo.PPOConfig, ppo.loss),  # decoupled PPO (AReaL); decoupled=False is standard PPO
    "grpo": (ppo.PPOConfig, ppo.loss),  # GRPO is PPO's surrogate with group advantages (rlcore.advantages)
    "dapo": (ppo.DAPOConfig, ppo.loss),  # clip-higher [0.8, 1.28] preset
    "gspo": (gspo.GSPOConfig, gspo.loss),  # sequence-level geometric-mean ratio
    "sapo": (sapo.SAPOConfig, sapo.loss),  # soft sigmoid gate instead of a clip
    "cispo": (cispo.CISPOConfig, cispo.loss),  # clipped, detached IS weight on REINFORCE
}

MASKS: dict[str, tuple[type, Callable]] = {
    "icepop": (icepop.IcePopConfig, icepop.keep_mask),
    "kpop": (kpop.KPopConfig, kpop.keep_mask),
    "m2po": (m2po.M2POConfig, m2po.keep_mask),
    "rejection": (rejection.RejectionConfig, rejection.keep_mask),
}

"""rlcore.objectives: pure loss functions and off-policy keep-masks over padded ``(b t)`` tensors.

Token objectives are values: each config (``ppo.PPOConfig``, ``ppo.DAPOConfig``, ``gspo.GSPOConfig``,
``sapo.SAPOConfig``, ``cispo.CISPOConfig``) is a frozen dataclass whose ``__call__`` is its leaf, with one signature
(house style rule 2)::

    objective(logp, logp_prox, logp_behav, adv, mask, *, denom=None, denom_mask=None, weight=None) -> (loss, metrics)

Each has the same ``decoupled`` switch (False: the ratio is taken against ``logp_behav`` and no behaviour weight
applies; True: against ``logp_prox``, times ``exp(logp_prox - logp_behav)`` or ``weight=``) and an ``agg`` field.
A mistyped keyword raises ``TypeError``. A new objective is: write the leaf and its config with ``__call__``, and
add the config to :data:`Objective` (the union the experiments' ``objective:`` field is typed with; one experiment
can also type its field with its own union); nothing is registered or looked up by name or type.

Keep-masks share one signature too: ``keep_mask(logp_prox, logp_behav, mask, *, cfg) -> (keep, weight, metrics)``
(IcePop, KPop, M2PO, rejection). ``weight (b t)`` is the factor the mask puts on the objective's own behaviour
weight: 1 for pure masks (IcePop, KPop, M2PO, token-level rejection masks), the TIS clamp / sequence geometric-mean
factor for ``rejection`` configs with ``carries_weight``. ``rejection.process`` returns the processed behaviour
weight itself (pass it as ``weight=`` to the objective). An experiment composes them in its own ``loss_fn`` with
plain Python and hands that function to ``rlcore.training.step.train_step``. Formulas, knobs and AReaL deviations:
docs/algorithms.md.

Non-token objectives (their own signatures, see docs/advantages.md): ``kl.estimate``/``kl.penalty``,
``entropy.from_logits``/``entropy.masked_mean``, ``value.loss`` (clipped critic), ``dpo.loss``,
``reward_model.loss``, ``sft.loss``, ``distill.loss``.
"""

from rlcore.objectives import cispo, gspo, ppo, sapo

Objective = ppo.PPOConfig | gspo.GSPOConfig | sapo.SAPOConfig | cispo.CISPOConfig
"""The token objectives an experiment may hold (``DAPOConfig`` is a ``PPOConfig``): the type of the ``objective``
field of experiments/tiny_cpu.py and experiments/gsm8k_grpo.py (each member a ``objective:<name>`` subcommand)."""

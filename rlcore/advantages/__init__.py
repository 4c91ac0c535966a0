"""rlcore.advantages: reward shaping, normalisation, GAE and proximal log-probs (docs/spec/algorithms.md §2–5).

Leaf modules, called through their module: ``shaping.shape_rewards``, ``normalize.normalize`` (presets
``normalize.GRPO`` …), ``gae.compute_advantages``, ``group.grpo`` / ``group.keep_not_all_equal``,
``prox.prox_logp``. See docs/advantages.md.
"""

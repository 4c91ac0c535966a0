"""Typed batches that cross module boundaries: frozen dataclasses of padded tensors with documented shapes.

Shape glossary: ``b`` rows (sequences), ``l`` padded width in token-own alignment, ``t`` padded width in
predictive alignment (``t == l``; position ``t`` scores token ``t+1``, docs/spec/algorithms.md §0.2).

* :class:`RolloutBatch` is what the rollout side produces (token-own alignment, docs/spec/system.md §1.3). The
  rollout wing still hands out ``dict[str, Tensor]``; :meth:`RolloutBatch.from_dict` / :meth:`to_dict` bridge it.
* :class:`TokenBatch` is what the train step and an experiment's ``loss_fn(logp, mb)`` see: the same rows in
  predictive alignment, plus every per-token input a loss may need as an optional field (proximal, reference
  and teacher log-probs, advantages, returns, old values, a per-token weight) and the GLOBAL counts the step
  fills in (``n_tokens``, ``n_seqs``: summed over the minibatch on every data-parallel rank).

Nothing here mutates a tensor it was given: derive a new batch with ``dataclasses.replace(batch, adv=...)``.
This module imports only torch (it sits below every wing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_ROLLOUT_TOKEN = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "turn_ids")
_ROLLOUT_ROW = ("rewards", "truncated", "group_ids")
_ROLL_FILL = {"input_ids": 0, "loss_mask": False, "logprobs": 0.0, "versions": -1, "turn_ids": -1}


def _roll_left(x: Tensor, fill: float | int | bool) -> Tensor:
    """``y[:, t] = x[:, t+1]``, last column ``fill`` (the single predictive shift, docs/spec/algorithms.md §0.2)."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)


@dataclass(frozen=True)
class RolloutBatch:
    """Padded rollout rows in token-own alignment (what workflows return; docs/spec/system.md §1.3)."""

    input_ids: Tensor
    """(b l) int64: prompt ++ generated (++ tool / feedback) tokens, right-padded."""
    attention_mask: Tensor
    """(b l) bool: True on the ``L_b`` real tokens (a prefix of every row)."""
    loss_mask: Tensor
    """(b l) bool: True exactly on the tokens the policy sampled."""
    logprobs: Tensor | None = None
    """(b l) float: behaviour log-prob of each sampled token at its own position (RL batches need it)."""
    versions: Tensor | None = None
    """(b l) int64: weight version that produced each sampled token, -1 elsewhere."""
    rewards: Tensor | None = None
    """(b,) float: one scalar outcome reward per row (RL batches need it)."""
    turn_ids: Tensor | None = None
    """(b l) int64: assistant-turn index of sampled tokens, -1 elsewhere (multi-turn)."""
    truncated: Tensor | None = None
    """(b,) bool: True for rows that hit the length limit without EOS (bootstrapped by GAE)."""
    group_ids: Tensor | None = None
    """(b,) int64: the prompt group of every row (``trajectory.concat_groups``); group statistics use these."""
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    """Any other keys of the source dict, passed through untouched (read-only by convention)."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"RolloutBatch.input_ids must be (b l), got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for k in _ROLLOUT_TOKEN:
            v = getattr(self, k)
            if v is not None and v.shape[:2] != shape:
                raise ValueError(f"RolloutBatch.{k} must have shape {tuple(shape)} like input_ids, got {tuple(v.shape)}")
        for k in _ROLLOUT_ROW:
            v = getattr(self, k)
            if v is not None and tuple(v.shape) != (shape[0],):
                raise ValueError(f"RolloutBatch.{k} must have shape ({shape[0]},) (one per row), got {tuple(v.shape)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Tensor]) -> RolloutBatch:
        """Build from a trajectory dict (``rlcore.data.trajectory``); unknown keys go to ``extras``."""
        missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in d]
        if missing:
            raise KeyError(f"trajectory dict lacks {missing}; build rows with rlcore.data.trajectory.make_row")
        names = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        kw: dict[str, Any] = {k: d[k] for k in names if k in d}
        kw["attention_mask"] = kw["attention_mask"].bool()
        kw["loss_mask"] = kw["loss_mask"].bool()
        return cls(**kw, extras={k: v for k, v in d.items() if k not in names})

    def to_dict(self) -> dict[str, Tensor]:
        """The trajectory dict again (None fields omitted, ``extras`` merged back)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extras}

    def require(self, *names: str) -> None:
        """Raise a ValueError naming every field in ``names`` that is None."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"RolloutBatch needs {missing} for this step; the rollout must record them")

    @property
    def num_rows(self) -> int:
        """Number of rows ``b``."""
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class TokenBatch:
    """Padded ``(b t)`` rows in predictive alignment: the train step's batch and ``loss_fn``'s micro-batch.

    Per-token fields are ``(b t)``; ``rewards``/``truncated``/``group_ids`` are ``(b,)``; ``n_tokens``/``n_seqs`` are 0-dim.
    Optional fields are None until an experiment (or the step) fills them with ``dataclasses.replace``.
    """

    input_ids: Tensor
    """(b t) int64: token at position t."""
    targets: Tensor
    """(b t) int64: token t+1 (the label scored at position t; 0 on the last column)."""
    attention_mask: Tensor
    """(b t) bool: True on real tokens (right-padded prefix)."""
    loss_mask: Tensor
    """(b t) bool: True where position t predicts a sampled token (spec ``m_t``)."""
    logp_behav: Tensor | None = None
    """(b t) float: behaviour log-probs of the engine, predictive (spec ``ℓ^beh``)."""
    versions: Tensor | None = None
    """(b t) int64: version of the token predicted at t, -1 if none (rlcore rolls versions, docs/spec/algorithms.md §5.3)."""
    turn_ids: Tensor | None = None
    """(b t) int64: turn index of the token predicted at t, -1 if none."""
    rewards: Tensor | None = None
    """(b,) float: outcome rewards."""
    truncated: Tensor | None = None
    """(b,) bool: rows that hit the length limit without EOS."""
    group_ids: Tensor | None = None
    """(b,) int64: the prompt group of every row (rows of a group share an id; groups may differ in size)."""
    logp_prox: Tensor | None = None
    """(b t) float: proximal log-probs (no-grad recompute or version interpolation)."""
    logp_ref: Tensor | None = None
    """(b t) float: reference-policy log-probs (KL penalty)."""
    logp_teacher: Tensor | None = None
    """(b t) float: teacher log-probs (on-policy distillation)."""
    adv: Tensor | None = None
    """(b t) float: advantages."""
    returns: Tensor | None = None
    """(b t) float: value targets (critic update)."""
    value_old: Tensor | None = None
    """(b t) float: pre-update critic values (clipped value loss)."""
    weight: Tensor | None = None
    """(b t) float: a per-token weight an experiment precomputed for its loss (e.g. a processed TIS weight)."""
    entropy: Tensor | None = None
    """(b t) float: policy entropy at the training temperature; set by ``train_step`` (with gradient)."""
    n_tokens: Tensor | None = None
    """0-dim float64: GLOBAL count of ``loss_mask`` tokens of the minibatch (all DP ranks); set by the step."""
    n_seqs: Tensor | None = None
    """0-dim float64: GLOBAL count of rows with at least one ``loss_mask`` token; set by the step."""
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    """Other per-row or per-token tensors an experiment carries along (sliced with the rows)."""

    @classmethod
    def from_rollout(cls, r: RolloutBatch | Mapping[str, Tensor]) -> TokenBatch:
        """The single left shift of docs/spec/algorithms.md §0.2: token-own rollout rows -> predictive alignment.

        ``targets = input_ids[:, t+1]``; ``loss_mask``, ``logprobs`` (-> ``logp_behav``), ``versions`` and
        ``turn_ids`` roll left by one and their last column gets the padding value.
        """
        r = r if isinstance(r, RolloutBatch) else RolloutBatch.from_dict(r)

        def roll(k: str) -> Tensor | None:
            v = getattr(r, k)
            return None if v is None else _roll_left(v, _ROLL_FILL[k])

        return cls(
            input_ids=r.input_ids, targets=roll("input_ids"), attention_mask=r.attention_mask, loss_mask=roll("loss_mask"),
            logp_behav=roll("logprobs"), versions=roll("versions"), turn_ids=roll("turn_ids"), rewards=r.rewards,
            truncated=r.truncated, group_ids=r.group_ids, extras=dict(r.extras),
        )

    @classmethod
    def from_predictive_dict(cls, d: Mapping[str, Tensor]) -> TokenBatch:
        """From a dict already in predictive alignment (``input_ids``, ``targets``, ``attention_mask`` at least;
        ``logprobs`` -> ``logp_behav``, ``teacher_logp`` -> ``logp_teacher``; a missing ``loss_mask`` is all False)."""
        if "targets" not in d or "attention_mask" not in d:
            raise KeyError("a predictive-aligned dict needs 'targets' and 'attention_mask'; use TokenBatch.from_rollout")
        rename = {"logprobs": "logp_behav", "teacher_logp": "logp_teacher"}
        names = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        kw: dict[str, Any] = {}
        extras: dict[str, Tensor] = {}
        for k, v in d.items():
            k2 = rename.get(k, k)
            (kw if k2 in names else extras)[k2] = v
        kw["attention_mask"] = kw["attention_mask"].bool()
        kw["loss_mask"] = kw["loss_mask"].bool() if "loss_mask" in kw else torch.zeros_like(kw["attention_mask"])
        return cls(**kw, extras=extras)

    def to_dict(self) -> dict[str, Tensor]:
        """Predictive-aligned dict of the non-None fields (``logp_behav`` keeps its name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extras}

    @property
    def num_rows(self) -> int:
        """Number of rows ``b``."""
        return int(self.input_ids.shape[0])

    @property
    def lengths(self) -> list[int]:
        """Real length ``L_b`` of every row (host ints)."""
        return [int(x) for x in self.attention_mask.sum(1).tolist()]

    def denom(self, agg: str) -> Tensor:
        """The GLOBAL normaliser an aggregation mode divides by: ``n_tokens`` for ``token_mean``, ``n_seqs`` for
        every per-sequence mode (``seq_mean_token_mean``, ``seq_mean_token_sum_norm``, ...)."""
        d = self.n_tokens if agg == "token_mean" else self.n_seqs
        if d is None:
            raise ValueError("TokenBatch.n_tokens/n_seqs are unset; train_step fills them (or call step.with_global_counts)")
        return d

    def select(self, rows: Sequence[int], *, trim: bool = True, width: int | None = None) -> TokenBatch:
        """Rows ``rows`` as a new batch; with ``trim`` the width shrinks to the longest selected row.

        ``width``: the trimmed width when the caller knows it on the host (the train step does), so selecting
        reads no tensor value (no device sync for a batch on a GPU); it must be >= the longest selected row.
        """
        b, full = self.input_ids.shape
        index = torch.as_tensor(list(rows), dtype=torch.long)
        if width is not None:
            w = min(int(width), full)
        else:
            w = max(int(self.attention_mask[index].sum(1).max()), 1) if trim and len(rows) else full
        width = full

        def take(v: Any) -> Any:
            if not isinstance(v, Tensor) or v.dim() == 0 or v.shape[0] != b:
                return v
            v = v.index_select(0, index.to(v.device, non_blocking=v.device.type == "cuda"))
            return v[:, :w] if v.dim() >= 2 and v.shape[1] == width else v

        kw = {f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extras"}
        return TokenBatch(**kw, extras={k: take(v) for k, v in self.extras.items()})

    def to(self, device: torch.device) -> TokenBatch:
        """Every tensor moved to ``device`` (host-to-device copies are non-blocking)."""

        def mv(v: Any) -> Any:
            if not isinstance(v, Tensor) or v.device == device:
                return v
            return v.to(device, non_blocking=v.device.type == "cpu" and device.type == "cuda")

        kw = {f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extras"}
        return TokenBatch(**kw, extras={k: mv(v) for k, v in self.extras.items()})


__all__ = ["RolloutBatch", "TokenBatch"]

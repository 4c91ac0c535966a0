"""Off-policy diagnostics of an RL step: the trainer-vs-engine log-prob mismatch on the FIRST (pre-update) forward.

``rlcore.diagnostics.offpolicy_metrics`` is the pure measurement; this module feeds it from a training step and
turns its staleness-0 number into a rate-limited warning (``rlcore.diagnostics.mismatch_warning``).

Which forward is "first": the proximal recompute (``step.policy_logp``) when the experiment makes one, since it
runs on the weights the engine tags as ``state.version``, before any update. Without a recompute (coupled PPO on
the engine's log-probs) it is ``train_step``'s own forward: inside ONE ``train_step`` call every micro-batch is
forwarded before the optimizer steps, so a ``loss_fn`` wrapped by :func:`first_forward` sees exactly the
pre-update log-probs of every row of that minibatch. With several PPO minibatches wrap the first call only
(the later ones run on already-updated weights).

The few lines an experiment writes (experiments/tiny_cpu.py, experiments/gpu_learning_run.py)::

    monitor = offpolicy.Monitor(cfg.offpolicy)                           # once, at setup
    ...
    version = state.version                                             # before train_step
    if batch.logp_prox is not None:                                     # decoupled: the recompute forward
        state, m = step.train_step(state, batch, loss_fn, cfg=step_cfg)
        m |= monitor(state.step, batch.logp_prox, batch, version=version)
    else:                                                               # coupled: train_step's first forward
        seen = offpolicy.first_forward(loss_fn)
        state, m = step.train_step(state, batch, seen, cfg=step_cfg)
        m |= monitor(state.step, *seen.logp_and_batch(), version=version)

A pure train function (tiny_cpu's replayable ``train_batch``) returns :func:`step_metrics` instead, and the loop
calls ``monitor.check(step, metrics)`` for the warning. docs/offpolicy.md lists the keys.

The staleness-0 warning needs tokens sampled by the trainer's current weights, which a run with ``max_staleness >= 1``
rarely consumes after its first step (the rollout runs a version ahead). The probe is the alarm that exists at every
staleness: right after each publish, while engine and trainer hold the same version, one short request is sampled
from the engine and re-scored by the trainer (:meth:`Monitor.probe`, ``offpolicy/probe_*``)::

    state = engines.publish(state, eng, rollout=ctl)                    # engine and trainer now hold state.version
    m |= monitor.probe(state.step, state.model, eng.targets[0], probe_ids, version=state.version)

Every call returns ``offpolicy/*`` floats (keys in ``rlcore.diagnostics``) plus ``offpolicy/warning`` (1.0 when
the staleness-0 mismatch exceeds the threshold, else 0.0) for TensorBoard; the warning text goes to ``log``
(default: stdout; also the ``rlcore.offpolicy`` logger) at most once every ``warn_every`` steps, and
``Monitor.warnings`` keeps every ``(step, text)`` it printed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlcore.diagnostics import DiagnosticsConfig, mismatch_warning, offpolicy_metrics
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.training import models
from rlcore.types import TokenBatch

LOG = logging.getLogger("rlcore.offpolicy")
LossFn = Callable[[Tensor, TokenBatch], tuple[Tensor, Mapping[str, Any]]]


@dataclass(frozen=True)
class OffPolicyConfig:
    """Off-policy diagnostics of every RL step."""

    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    """Ratio band, staleness buckets, position buckets and quantiles of the mismatch metrics."""
    warn_threshold: float = 0.05
    """Warn when tokens sampled by the CURRENT weights (staleness 0) differ from the trainer's log-probs by more
    than this many nats on average (float32 engine and trainer agree to ~1e-6; a bf16 engine to ~1e-2)."""
    warn_every: int = 100
    """Print the warning at most once every this many steps (``offpolicy/warning`` is logged every step)."""
    probe_tokens: int = 16
    """Tokens the engine samples (temperature 1) for one :meth:`Monitor.probe`, each re-scored by the trainer; the
    probe warns when their mean |engine − trainer| log-prob exceeds ``warn_threshold``."""
    probe_every: int = 1
    """Probe after every this many publishes (0: never); an experiment's loop reads it."""

    def __post_init__(self) -> None:
        if not self.warn_threshold > 0:
            raise ValueError(f"OffPolicyConfig.warn_threshold must be > 0 nats, got {self.warn_threshold}; e.g. 0.05")
        if self.warn_every < 1:
            raise ValueError(f"OffPolicyConfig.warn_every must be >= 1 step, got {self.warn_every}")
        if self.probe_tokens < 1:
            raise ValueError(f"OffPolicyConfig.probe_tokens must be >= 1, got {self.probe_tokens}")
        if self.probe_every < 0:
            raise ValueError(f"OffPolicyConfig.probe_every must be >= 0 (0: no probe), got {self.probe_every}")


def staleness(batch: TokenBatch, version: int, *, kv_kept: bool = False) -> Tensor:
    """``(b t)`` int: ``version − batch.versions`` on sampled tokens (0 where a token has no version).

    ``kv_kept``: the engine kept the KV of requests in flight across weight loads (``kv_after_update="keep"``
    with a pause that keeps requests: ``in_place``, ``retract`` or none), so a token's log-prob also depends on the
    older weights that computed its request's KV. Its staleness is then counted from the oldest version among the
    sampled tokens of its own request up to it (a running minimum along ``t`` that restarts where a new request
    begins: the first sampled token after unsampled ones, e.g. a later turn after a tool answer, or a new
    ``turn_ids`` value), since a new request is prefilled fresh under the weights of its first token. Staleness 0
    still means "computed by the current weights alone". With the default re-prefill the tag is exact. A segment
    resubmitted inside one turn after an ``abort`` pause is prefilled fresh too but cannot be told apart here:
    pass ``kv_kept=False`` for an ``abort`` pause (no request crosses a load with its KV then)."""
    if batch.versions is None:
        return torch.zeros_like(batch.loss_mask, dtype=torch.long)
    v = batch.versions.long()
    if kv_kept:
        v = torch.where(v >= 0, _request_oldest(v, batch.turn_ids), v)
    return torch.where(v >= 0, version - v, torch.zeros_like(v)).clamp(min=0)


_NO_VERSION = 1 << 30  # larger than any weight version: unsampled positions never lower a running minimum


def _request_oldest(v: Tensor, turn_ids: Tensor | None) -> Tensor:
    """``(b t)``: the least version among the sampled tokens ``v >= 0`` of the same request up to ``t``. A request
    starts at a sampled token whose predecessor is unsampled (or at ``t = 0``), or where ``turn_ids`` changes."""
    sampled = v >= 0
    prev = torch.cat([torch.zeros_like(sampled[:, :1]), sampled[:, :-1]], dim=1)
    start = sampled & ~prev
    if turn_ids is not None and turn_ids.shape == v.shape:
        tid = turn_ids.long()
        start |= sampled & torch.cat([torch.zeros_like(sampled[:, :1]), tid[:, 1:] != tid[:, :-1]], dim=1)
    seg = torch.cumsum(start.long(), dim=1)
    eff = torch.where(sampled, v, torch.full_like(v, _NO_VERSION))
    # segmented running minimum: seg * 2^31 dominates, so cummax of (seg * 2^31 - version) restarts per request
    key = torch.cummax(seg * (1 << 31) - eff, dim=1).values
    return seg * (1 << 31) - key


def step_metrics(
    logp: Tensor, batch: TokenBatch, *, version: int, cfg: DiagnosticsConfig = DiagnosticsConfig(),
    kv_kept: bool = False,
) -> dict[str, Tensor]:
    """``offpolicy_metrics`` of the trainer's ``logp`` ``(b t)`` against ``batch.logp_behav`` on ``batch.loss_mask``,
    bucketed by the staleness of each token at trainer weight ``version`` (``kv_kept``: see :func:`staleness`)."""
    if batch.logp_behav is None:
        raise ValueError("off-policy diagnostics need TokenBatch.logp_behav (the engine's log-probs of the samples)")
    dev = logp.device
    return offpolicy_metrics(logp, batch.logp_behav.to(dev), batch.loss_mask.to(dev),
                             staleness=staleness(batch, version, kv_kept=kv_kept).to(dev), cfg=cfg)


class FirstForward:
    """A ``loss_fn`` that records the detached ``(b t)`` log-probs and micro-batch of every call, then defers to
    the wrapped one. Within one ``train_step`` call those are the pre-update log-probs of all its rows."""

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn
        self.parts: list[tuple[Tensor, TokenBatch]] = []

    def __call__(self, logp: Tensor, mb: TokenBatch) -> tuple[Tensor, Mapping[str, Any]]:
        self.parts.append((logp.detach().cpu(), mb))
        return self.loss_fn(logp, mb)

    def logp_and_batch(self) -> tuple[Tensor, TokenBatch]:
        """The recorded micro-batches stacked into one right-padded ``(b t)`` batch (rows in micro-batch order,
        not the caller's: every metric here is a per-token or per-row statistic, so order does not matter)."""
        if not self.parts:
            raise RuntimeError("first_forward(loss_fn) was never called: pass it to train_step before reading it")
        width = max(lp.shape[1] for lp, _ in self.parts)

        def pad(x: Tensor, fill: float | int | bool) -> Tensor:
            x = x.cpu()
            return torch.cat([x, torch.full((x.shape[0], width - x.shape[1]), fill, dtype=x.dtype)], 1)

        def cat(name: str, fill: float | int | bool) -> Tensor | None:
            xs = [getattr(mb, name) for _, mb in self.parts]
            return None if any(x is None for x in xs) else torch.cat([pad(x, fill) for x in xs])

        logp = torch.cat([pad(lp, 0.0) for lp, _ in self.parts])
        ids = cat("input_ids", 0)
        batch = TokenBatch(input_ids=ids, targets=cat("targets", 0), attention_mask=cat("attention_mask", False),
                           loss_mask=cat("loss_mask", False), logp_behav=cat("logp_behav", 0.0),
                           versions=cat("versions", -1))
        return logp, batch


def first_forward(loss_fn: LossFn) -> FirstForward:
    """Wrap ``loss_fn`` so the next ``train_step`` call's (pre-update) log-probs can be read back afterwards."""
    return FirstForward(loss_fn)


def probe_engine(
    target: Any, prompt_ids: Sequence[int], max_new_tokens: int, *, seed: int = 0, timeout_s: float = 300.0
) -> tuple[list[int], list[float], list[int]]:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids`` from ``target`` at temperature 1 (EOS ignored): an
    engine (``Engine.generate``; also a rollout process's ``rp.engine``) or a blocking client (``generate`` of a
    ``ModelRequest``, e.g. ``SyncEngineClient``). Returns the token
    ids, the engine's log-probs of them and their weight versions (each a list of length ``max_new_tokens`` or
    fewer)."""
    sp = SamplingParams(max_new_tokens=int(max_new_tokens), temperature=1.0, ignore_eos=True, seed=int(seed))
    ids = [int(t) for t in prompt_ids]
    if hasattr(target, "update_weights_from_state_dict"):  # an engine (or a rollout process's remote engine)
        out = target.generate(ids, sp, rid=f"offpolicy-probe-{uuid.uuid4().hex[:8]}", timeout=timeout_s)
        return list(out.output_ids), [float(x) for x in out.output_logprobs], [int(v) for v in out.output_versions]
    if hasattr(target, "generate"):
        r = target.generate(ModelRequest(input_ids=ids, sampling=sp, rid=f"offpolicy-probe-{uuid.uuid4().hex[:8]}"))
        return list(r.output_tokens), [float(x) for x in r.output_logprobs], [int(v) for v in r.output_versions]
    raise TypeError(f"probe target must be an in-process engine (submit) or a blocking client (generate), got "
                    f"{type(target).__name__}")


def probe_metrics(
    model: torch.nn.Module, prompt_ids: Sequence[int], ids: Sequence[int], logps: Sequence[float],
    versions: Sequence[int], *, version: int,
) -> dict[str, float]:
    """Re-score the engine's probe sample ``ids`` (after ``prompt_ids``) with the trainer's ``model`` (raw log-probs,
    temperature 1) on the tokens the engine labelled ``version``. Returns ``offpolicy/probe_tokens`` (how many were
    compared), ``offpolicy/probe_abs_diff_mean`` and ``offpolicy/probe_abs_diff_max`` in nats (the latter two
    absent when no token carried ``version``)."""
    keep = [i for i, v in enumerate(versions) if int(v) == int(version)]
    if not keep or not ids:
        return {"offpolicy/probe_tokens": 0.0}
    hf = models.hf_module(model)
    dev = next(hf.parameters()).device
    full = torch.tensor([[*map(int, prompt_ids), *map(int, ids)]], device=dev)
    with torch.no_grad():
        logits = hf(input_ids=full).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, full[0, len(prompt_ids):, None])[:, 0].cpu()
    diff = (lp[keep] - torch.tensor([float(logps[i]) for i in keep])).abs()
    return {"offpolicy/probe_tokens": float(len(keep)), "offpolicy/probe_abs_diff_mean": float(diff.mean()),
            "offpolicy/probe_abs_diff_max": float(diff.max())}


def _print(text: str) -> None:
    print(text, flush=True)


@dataclass
class Monitor:
    """Per-step off-policy metrics plus the rate-limited staleness-0 mismatch warning."""

    cfg: OffPolicyConfig = OffPolicyConfig()
    log: Callable[[str], None] | None = None
    """Where the warning text goes (default: stdout; e.g. ``tqdm.write``). It is also logged at INFO level to the
    ``rlcore.offpolicy`` logger."""
    warnings: list[tuple[int, str]] = field(default_factory=list)
    """Every ``(step, text)`` printed so far."""
    fired: int = 0
    """Steps whose staleness-0 mismatch exceeded the threshold (printed or not)."""
    kv_kept: bool = False
    """The engine keeps KV across weight loads (``kv_after_update="keep"``): staleness counts from the oldest
    weights that shaped a token (:func:`staleness`), so kept-KV tokens do not trip the staleness-0 warning."""

    def __call__(self, step: int, logp: Tensor, batch: TokenBatch, *, version: int) -> dict[str, float]:
        """Metrics of this step's first forward ``logp`` ``(b t)`` on ``batch`` at trainer weight ``version``."""
        return self.check(step, step_metrics(logp, batch, version=version, cfg=self.cfg.diagnostics,
                                             kv_kept=self.kv_kept))

    def probe(
        self, step: int, model: torch.nn.Module, target: Any, prompt_ids: Sequence[int], *, version: int,
        seed: int | None = None,
    ) -> dict[str, float]:
        """The mismatch alarm that exists at every staleness: call right after a publish (engine and trainer both
        hold ``version``), before the next update. One ``probe_tokens`` sample from ``target``
        (:func:`probe_engine`) re-scored by ``model`` (:func:`probe_metrics`); ``offpolicy/probe_warning`` is 1.0
        (and the warning is printed, rate-limited like the staleness-0 one) when the mean difference exceeds
        ``warn_threshold``: the engine does not hold the weights the trainer published. Single trainer rank
        (or call it on every rank: the re-scoring is a forward of ``model``)."""
        ids, logps, versions = probe_engine(target, prompt_ids, self.cfg.probe_tokens,
                                            seed=step if seed is None else seed)
        m = probe_metrics(model, prompt_ids, ids, logps, versions, version=version)
        diff = m.get("offpolicy/probe_abs_diff_mean")
        fires = diff is not None and diff > self.cfg.warn_threshold
        if fires:
            self.fired += 1
            if not self.warnings or step - self.warnings[-1][0] >= self.cfg.warn_every:
                text = (f"[step {step}] WARNING engine/trainer mismatch on a probe sampled by version {version}: "
                        f"{diff:.3g} nats mean |dlogp| over {int(m['offpolicy/probe_tokens'])} tokens > "
                        f"{self.cfg.warn_threshold}: the engine does not hold the weights the trainer published "
                        "(a failed or partial load, wrong names or dtype, a sampling setting)")
                self.warnings.append((step, text))
                LOG.info(text)
                (self.log or _print)(text)
        return m | {"offpolicy/probe_warning": float(fires)}

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The warning part alone, on metrics a step already computed with :func:`step_metrics` (a pure train
        function returns them; the experiment's loop owns this stateful monitor). Returns the ``offpolicy/*``
        floats of ``metrics`` plus ``offpolicy/warning``."""
        m = {k: float(v) for k, v in metrics.items() if k.startswith("offpolicy/")}
        msg = mismatch_warning(m, self.cfg.warn_threshold)
        if msg is not None:
            self.fired += 1
            if not self.warnings or step - self.warnings[-1][0] >= self.cfg.warn_every:
                text = f"[step {step}] WARNING {msg}"
                self.warnings.append((step, text))
                LOG.info(text)  # for applications that route logging; the text itself goes to ``log``
                (self.log or _print)(text)
        return m | {"offpolicy/warning": float(msg is not None)}

__all__ = ["OffPolicyConfig", "FirstForward", "Monitor", "first_forward", "probe_engine", "probe_metrics", "staleness",
           "step_metrics"]

"""The train step: ``train_step(state, batch, loss_fn, *, cfg) -> (state, metrics)`` (house style rule 11).

``train_step`` is the only function that changes parameters. It owns mechanics only: it cuts one minibatch
(a :class:`rlcore.types.TokenBatch`) into micro-batches under a token budget (``rlcore.data.microbatch``; the
default ``"auto"`` budget is the largest that fits the free CUDA memory, ``rlcore.training.memory_budget``), packs
each one (``rlcore.data.packing``), runs the forward (policy log-probs + entropy at the training temperature, or
critic values), fills the GLOBAL counts ``mb.n_tokens`` / ``mb.n_seqs`` (summed over every micro-batch of the
minibatch on every data-parallel rank), calls ``loss_fn(logp, mb) -> (loss, metrics)``, backpropagates, clips,
skips a non-finite step (gradients zeroed, ``skipped_steps`` + 1, weights untouched), and steps the optimizer and
scheduler. One call = one optimizer step.

The experiment writes ``loss_fn`` from leaves with plain Python; it normalises by the global count its
aggregation names (``mb.denom(cfg.agg)``: tokens for ``token_mean``, sequences for the ``seq_mean_*`` modes),
so ``J = Σ_μ L_μ`` is independent of how the minibatch is split into micro-batches and ranks. Everything else
an RL step needs is a small function the experiment calls explicitly, before ``train_step``:
:func:`policy_logp` (proximal recompute), :func:`ref_logp`, :func:`teacher_logp`, :func:`critic_values`,
:func:`old_logp` (which tensor is ``ℓ^old``, docs/spec/algorithms.md §4.1), :func:`minibatches` (the advantages are
``rlcore.advantages.estimate``),
and the critic update is ``train_step(state, batch, value_loss_fn(cfg), cfg=StepConfig(module="critic"))``.

SFT, DPO and reward models are ``train_step`` with :func:`sft_loss_fn`, :func:`dpo_loss_fn`, :func:`rm_loss_fn`.
No objective or mask is looked up by name or type here: the loss is the function the experiment passes.

Ordering / concurrency: a step must not run while ``weight_sync.publish_weights`` reads the parameters; the
training loop calls them one after the other on every rank. Every rank must call ``train_step`` and the
forward helpers the same number of times (they run collectives under FSDP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlcore.data import microbatch, packing
from rlcore.objectives import dpo as dpo_lib
from rlcore.objectives import reward_model as rm_lib
from rlcore.objectives import sft as sft_lib
from rlcore.objectives import value as value_lib
from rlcore.training import fsdp, memory_budget
from rlcore.training.train_state import TrainState
from rlcore.types import TokenBatch

Metrics = dict[str, Tensor | float]
LossFn = Callable[[Tensor, TokenBatch], tuple[Tensor, Mapping[str, Any]]]
"""``loss_fn(logp (b t), mb) -> (scalar loss, metrics)``: ``logp`` carries the gradient (critic: values)."""


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepConfig:
    """Mechanics of one ``train_step`` call (no algorithm in here)."""

    mb: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig()
    """Micro-batch budget and allocator (``granularity=2`` keeps DPO / RM pairs in one micro-batch); the default
    budget ``"auto"`` is the largest that fits on CUDA and unlimited on CPU."""
    pad_to_multiple: int | None = None
    """Pad each packed micro-batch to a multiple of this many tokens (e.g. 256 on GPUs)."""
    temperature: float = 1.0
    """Training softmax temperature; must equal the sampling temperature."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (non-finite norms still skip the step)."""
    module: Literal["policy", "critic"] = "policy"
    """Which model/optimizer/scheduler of the state to update: ``state.model`` or ``state.critic``."""
    schedule: bool = True
    """This call ends a training step: advance the LR schedule (and, for the policy, ``TrainState.step``). Set False
    on all but the last minibatch of a training step, so both advance once per training step (docs/spec/system.md §7.6)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"StepConfig.temperature must be > 0, got {self.temperature}")
        if self.max_grad_norm < 0:
            raise ValueError(f"StepConfig.max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")


# ----------------------------------------------------------------------------------------------------------
# Alignment, micro-batches and forward passes
# ----------------------------------------------------------------------------------------------------------


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    dev = p.device
    return torch.device("cuda", torch.cuda.current_device()) if type(p).__name__ == "DTensor" and dev.type == "cuda" else dev


def _h2d(x: Tensor, dev: torch.device) -> Tensor:
    """Host-to-device copy without a stream sync (safe: the host source is staged before the call returns)."""
    return x.to(dev, non_blocking=x.device.type == "cpu" and dev.type == "cuda")


def _forward_padded(
    model: nn.Module,
    mb: TokenBatch,
    *,
    temperature: float,
    pad_to_multiple: int | None,
    lengths: list[int] | None = None,
) -> tuple[Tensor, ...]:
    """Pack ``mb`` (padded ``(b t)`` with ``targets``), run ``model``, scatter outputs back to ``(b t)``.

    ``lengths``: the rows' real lengths on the host (the step knows them), so packing reads no tensor value.
    """
    dev = _device_of(model)
    pk = packing.pack(
        {"input_ids": mb.input_ids, "targets": mb.targets, "attention_mask": mb.attention_mask},
        pad_to_multiple=pad_to_multiple, lengths=lengths,
    )
    out = model(
        _h2d(pk.tokens["input_ids"], dev),
        _h2d(pk.position_ids, dev),
        _h2d(pk.tokens["targets"], dev),
        temperature=temperature,
        cu_seqlens=_h2d(pk.cu_seqlens, dev),
        max_seqlen=pk.max_seqlen,
    )
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(packing.unpack_tensor(o, pk, fill=0) for o in outs)


def _dummy_forward(model: nn.Module, *, temperature: float) -> Tensor:
    """A one-token forward whose output is multiplied by 0: keeps FSDP collectives in lock-step."""
    dev = _device_of(model)
    z = torch.zeros(1, dtype=torch.long, device=dev)
    out = model(z, z, z, temperature=temperature)
    first = out[0] if isinstance(out, tuple) else out
    return first.sum() * 0.0


def global_sum(x: Tensor | float) -> Tensor:
    """Sum of a host scalar/vector over all data-parallel ranks (float64 CPU; the value itself without a group)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        y = x.detach().to(dev).clone()
        dist.all_reduce(y)
        return y.cpu()
    return x.detach().cpu().clone()


def with_global_counts(batch: TokenBatch) -> TokenBatch:
    """``batch`` with ``n_tokens`` (loss-mask tokens) and ``n_seqs`` (rows with >= 1 such token) summed over DP ranks.

    These are the denominators of docs/spec/algorithms.md §0.4: token modes divide by ``n_tokens``, per-sequence modes by ``n_seqs``.
    """
    m = batch.loss_mask.bool()
    n = global_sum(torch.stack([m.sum().double(), (m.sum(-1) > 0).sum().double()]).cpu())
    return dataclasses.replace(batch, n_tokens=n[0], n_seqs=n[1])


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def device_stream(device: torch.device, mode: Literal["high_priority", "current"] = "high_priority") -> Iterator[None]:
    """Run the block's CUDA work on this device's high-priority stream (CPU, or ``mode="current"``: nothing changes).

    For an engine thread sharing the GPU with the trainer in one process: wrap the WHOLE update (proximal forward,
    advantages, ``train_step``) in one block, so the trainer's kernels do not queue behind the engine's (default
    stream) and the engine's fill the update's idle gaps. On one H200 (bench_trl shapes, engine thread, KV kept
    across pushes; docs/benchmarks.md) η = 4 / η = 0 was 1.23, 1.10, 1.45, 1.15 with the block against
    1.07, 1.12, 1.15, 1.16 on one stream, but η = 4's own samples/s did not clearly rise (90.9–107.0 vs 92.0–100.5):
    a small, noisy effect. A block per call (proximal forward, then ``train_step``) did worse (0.99–1.09).

    The stream first waits for the caller's current stream (inputs queued there are ready), and the host waits for
    it at the end, so what the block returns or updates in place (parameters, optimizer state) is complete for any
    stream that reads it next (a weight publish, the engine)."""
    if mode not in ("high_priority", "current"):
        raise ValueError(f"device_stream mode must be 'high_priority' or 'current', got {mode!r}")
    if device.type != "cuda" or mode == "current":
        yield
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


@torch.no_grad()
def _forward_nograd(model: nn.Module, batch: TokenBatch, *, cfg: StepConfig) -> tuple[Tensor, ...]:
    """No-grad packed forward over a whole batch; outputs ``(b t)`` on the batch's device, 0 past ``L_b - 1``.

    Outputs stay on the model's device until every micro-batch ran (one transfer at the end, no host sync
    inside the loop)."""
    was_training = model.training
    model.eval()
    try:
        b, width = batch.input_ids.shape
        home = batch.input_ids.device
        lengths = batch.lengths
        results: list[Tensor] | None = None
        for rows in memory_budget.MicroBatches(model, lengths, cfg.mb, device=_device_of(model), training=False):
            if not rows:
                _dummy_forward(model, temperature=cfg.temperature)
                continue
            sub = [lengths[i] for i in rows]
            outs = _forward_padded(
                model, batch.select(rows, width=max(max(sub), 1)), temperature=cfg.temperature,
                pad_to_multiple=cfg.pad_to_multiple, lengths=sub,
            )
            if results is None:
                results = [torch.zeros(b, width, dtype=o.dtype, device=o.device) for o in outs]
            idx = torch.as_tensor(rows, dtype=torch.long).to(outs[0].device, non_blocking=True)
            for r, o in zip(results, outs):
                r[idx, : o.shape[1]] = o
        if results is None:
            results = [torch.zeros(b, width)]
        results = [r.to(home) for r in results]
        len_t = torch.as_tensor(lengths, dtype=torch.long, device=home)
        last = torch.arange(width, device=home)[None, :] < (len_t[:, None] - 1)
        return tuple(torch.where(last, r, torch.zeros((), dtype=r.dtype, device=r.device)) for r in results)
    finally:
        model.train(was_training)


@torch.no_grad()
def forward_logp(
    model: nn.Module,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    mb_cfg: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig(),
    pad_to_multiple: int | None = None,
) -> tuple[Tensor, ...]:
    """No-grad forward over a padded batch in packed micro-batches (prox / ref / teacher / values / eval).

    Args:
      model: a ``PolicyModel`` (returns ``(logp, entropy)``) or ``CriticModel`` (returns ``values``).
      batch: a :class:`TokenBatch` (``TokenBatch.from_rollout`` of the rollout rows: the one predictive shift).
      temperature: softmax temperature.
      mb_cfg: micro-batch budget (every rank must call this the same number of times).

    Returns:
      The model outputs scattered back to ``(b t)`` in predictive alignment (position t scores token t+1),
      on the batch's device; positions beyond each row's length (and the last real position) are 0.
    """
    if not isinstance(batch, TokenBatch):
        raise TypeError(f"forward_logp takes a TokenBatch, got {type(batch).__name__}; wrap rollout rows with "
                        "TokenBatch.from_rollout(rows)")
    cfg = StepConfig(mb=mb_cfg, pad_to_multiple=pad_to_multiple, temperature=temperature)
    return _forward_nograd(model, batch, cfg=cfg)


# ----------------------------------------------------------------------------------------------------------
# Optimizer step with the finiteness guard
# ----------------------------------------------------------------------------------------------------------


def _optimizer_step(
    model: nn.Module, optim: torch.optim.Optimizer, loss_sum: Tensor, max_grad_norm: float
) -> tuple[bool, Tensor]:
    """Clip, check finiteness of loss and grad norm (globally), then step or zero the gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    # one device -> host transfer for both checks (the step's only sync besides the metrics at the end)
    both = torch.stack([fsdp.scalar(norm).detach().double().reshape(()), loss_sum.detach().double().reshape(())]).cpu()
    norm = both[0].float()
    loss_ok = bool(torch.isfinite(global_sum(both[1:])).all())
    ok = loss_ok and bool(torch.isfinite(norm))
    if ok:
        optim.step()
    optim.zero_grad(set_to_none=True)
    return ok, norm


def _sched_step(sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the LR schedule once per training step, even when every optimizer step was skipped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        sched.step()


def _accumulate(acc: dict[str, Tensor], metrics: Mapping[str, Any], w: float) -> None:
    """``acc[k] += w · metrics[k]`` for scalar metrics, kept on their device (no host sync per micro-batch)."""
    for k, v in metrics.items():
        if isinstance(v, Tensor) and v.numel() != 1:
            continue
        v = torch.as_tensor(v).detach().float().reshape(())
        prev = acc.get(k)
        if prev is None:
            acc[k] = w * v
            continue
        # never copy device -> host here (a sync): a host value moves to the device without blocking
        dev = v.device if v.device.type != "cpu" else prev.device
        acc[k] = prev.to(dev, non_blocking=True) + w * v.to(dev, non_blocking=True)


def _to_host(metrics: Mapping[str, Any]) -> Metrics:
    """All metric tensors to the host at the end of a step: the device scalars in ONE transfer (one sync)."""
    out: Metrics = {k: (v.detach().cpu() if isinstance(v, Tensor) and v.device.type == "cpu" else v)
                    for k, v in metrics.items()}
    dev = [k for k, v in metrics.items() if isinstance(v, Tensor) and v.device.type != "cpu" and v.numel() == 1]
    if dev:
        host = torch.stack([metrics[k].detach().double().reshape(()) for k in dev]).cpu()
        out.update({k: host[i].to(metrics[k].dtype).reshape(metrics[k].shape) for i, k in enumerate(dev)})
    for k, v in metrics.items():  # non-scalar device tensors (rare): one copy each
        if isinstance(v, Tensor) and v.device.type != "cpu" and v.numel() != 1:
            out[k] = v.detach().cpu()
    return out


def _slot(state: TrainState, module: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    if module == "policy":
        return state.model, state.optim, state.sched
    if state.critic is None or state.critic_optim is None:
        raise ValueError("StepConfig.module='critic' needs TrainState.critic; init_train_state(..., critic=True)")
    return state.critic, state.critic_optim, state.critic_sched


# ----------------------------------------------------------------------------------------------------------
# The train step
# ----------------------------------------------------------------------------------------------------------


def train_step(
    state: TrainState, batch: TokenBatch, loss_fn: LossFn, *, cfg: StepConfig = StepConfig()
) -> tuple[TrainState, Metrics]:
    """One optimizer step of ``loss_fn`` on this rank's minibatch ``batch`` (predictive ``(b t)``).

    ``loss_fn(logp, mb)`` gets the micro-batch's ``(b t)`` log-probs with gradient (critic: values) and the
    micro-batch ``mb`` on the same device, with ``mb.entropy`` set and the GLOBAL ``mb.n_tokens``/``mb.n_seqs``;
    it must return a loss already divided by the global count its aggregation names (``mb.denom(agg)``), so the
    step just sums micro-batch losses (``J = Σ_μ L_μ``, docs/spec/algorithms.md §0.4). Returns the state with ``step + 1`` when this
    call ends a training step (``cfg.schedule`` on the policy: the last minibatch; ``TrainState.step`` counts training
    steps and this is its one writer; a critic or an earlier minibatch leaves it), and
    ``skipped_steps + 1`` when the loss or gradient norm was not finite: gradients zeroed, weights untouched) and
    metrics: ``loss_fn``'s (micro-batch means weighted by token share) plus ``train/{loss,grad_norm,
    update_successful,lr,n_microbatches}``, ``train/mb_tokens_budget`` (the budget applied, absent when unlimited;
    ``"auto"`` resolves it from the free CUDA memory, ``rlcore.training.memory_budget``), ``timing/step_s``,
    ``perf/tokens_per_s``. ``batch`` itself is never modified.
    """
    t_start = time.perf_counter()
    model, optim, sched = _slot(state, cfg.module)
    batch = with_global_counts(batch)
    dp = fsdp.dp_size()
    loss_sum = torch.zeros((), dtype=torch.float64, device=_device_of(model))
    # host bookkeeping once per step: lengths and per-row loss-token counts (no tensor reads per micro-batch)
    lengths = batch.lengths
    row_tokens = [int(x) for x in batch.loss_mask.sum(1).tolist()]
    n_local, b_local = float(sum(row_tokens)), max(batch.num_rows, 1)
    acc: dict[str, Tensor] = {}
    plan = memory_budget.MicroBatches(model, lengths, cfg.mb, device=loss_sum.device, training=True)
    for rows in plan:  # with "auto" the first step measures memory per token between micro-batches
        if not rows:  # another rank has more micro-batches: a zero-weight forward keeps collectives in step
            _dummy_forward(model, temperature=cfg.temperature).backward()
            continue
        sub = [lengths[i] for i in rows]
        mb = batch.select(rows, width=max(max(sub), 1))
        outs = _forward_padded(model, mb, temperature=cfg.temperature, pad_to_multiple=cfg.pad_to_multiple, lengths=sub)
        mb = dataclasses.replace(mb.to(outs[0].device), entropy=outs[1] if len(outs) > 1 else None)
        loss, m = loss_fn(outs[0], mb)
        (loss * dp).backward()  # dp undoes FSDP's gradient averaging: DP gradients become a sum
        loss_sum = loss_sum + loss.detach().double().to(loss_sum.device)
        share = sum(row_tokens[i] for i in rows) / n_local if n_local > 0 else len(rows) / b_local
        _accumulate(acc, m, share)
    ok, norm = _optimizer_step(model, optim, loss_sum, cfg.max_grad_norm)
    acc["train/lr"] = torch.tensor(float(optim.param_groups[0]["lr"]))
    acc["train/n_microbatches"] = torch.tensor(float(plan.count))
    if plan.budget is not None:
        acc["train/mb_tokens_budget"] = torch.tensor(float(plan.budget))
    if cfg.schedule and sched is not None:
        _sched_step(sched)
    dt = time.perf_counter() - t_start
    acc.update({"train/loss": loss_sum.float(), "train/grad_norm": norm, "train/update_successful": torch.tensor(float(ok)),
                "timing/step_s": torch.tensor(dt),
                "perf/tokens_per_s": torch.tensor(float(sum(lengths)) / max(dt, 1e-9))})
    ends = cfg.schedule and cfg.module == "policy"  # the last minibatch of a training step: the one step writer
    new_state = dataclasses.replace(state, step=state.step + int(ends),
                                    skipped_steps=state.skipped_steps + (0 if ok else 1))
    return new_state, _to_host(acc)


# ----------------------------------------------------------------------------------------------------------
# Small functions the experiment calls around train_step
# ----------------------------------------------------------------------------------------------------------


def policy_logp(state: TrainState, batch: TokenBatch, *, cfg: StepConfig = StepConfig()) -> Tensor:
    """Proximal log-probs ``(b t)``: a no-grad forward of the current policy before the update (docs/spec/algorithms.md §5.1)."""
    logp = _forward_nograd(state.model, batch, cfg=cfg)[0]
    if not bool(torch.isfinite(torch.where(batch.loss_mask, logp, 0.0)).all()):
        raise FloatingPointError("recomputed proximal log-probs contain NaN/inf on trained tokens")
    return logp


def ref_logp(state: TrainState, batch: TokenBatch, *, cfg: StepConfig = StepConfig()) -> Tensor:
    """Reference-policy log-probs ``(b t)`` (KL penalty, DPO); needs ``state.ref``."""
    if state.ref is None:
        raise ValueError("a KL penalty / DPO needs a frozen reference policy but TrainState.ref is None; pass ref=True")
    return _forward_nograd(state.ref, batch, cfg=cfg)[0]


def teacher_logp(teacher: nn.Module, batch: TokenBatch, *, cfg: StepConfig = StepConfig()) -> Tensor:
    """Teacher log-probs ``(b t)`` for on-policy distillation (a frozen ``PolicyModel``)."""
    return _forward_nograd(teacher, batch, cfg=cfg)[0]


def critic_values(state: TrainState, batch: TokenBatch, *, cfg: StepConfig = StepConfig()) -> Tensor:
    """Pre-update critic values ``(b t)`` (docs/spec/algorithms.md §1 step 2); needs ``state.critic``."""
    if state.critic is None:
        raise ValueError("critic_values needs TrainState.critic; init_train_state(..., critic=True)")
    return _forward_nograd(state.critic, batch, cfg=cfg)[0]


def proximal_logp(logp: Tensor, mb: TokenBatch) -> Tensor:
    """``ℓ^prox (b t)`` inside a ``loss_fn``: ``mb.logp_prox`` when the caller set it, else the detached ``logp`` of
    this very forward. ``train_step`` takes ONE optimizer step after all micro-batches, so every forward of the
    call runs the weights the step starts from: those are the proximal weights, and their log-probs need no second
    forward (docs/spec/algorithms.md §5.1 ``recompute``, fused into the training forward; the PPO ratio is then exactly 1 in value).
    An experiment that takes several optimizer steps per batch (minibatches) sets ``logp_prox`` with
    :func:`policy_logp` before the first one."""
    return logp.detach() if mb.logp_prox is None else mb.logp_prox


def old_logp(batch: TokenBatch, *, coupled_recompute: bool) -> Tensor:
    """``ℓ^old`` of docs/spec/algorithms.md §4.1 ``(b t)``: the recomputed ``logp_prox`` for coupled PPO with recomputed log-probs,
    the behaviour log-probs otherwise (decoupled PPO, or coupled PPO on engine log-probs). It is the ``logp_old``
    of the KL-in-reward term and, for coupled PPO, the behaviour input of the objective."""
    t = batch.logp_prox if coupled_recompute else batch.logp_behav
    if t is None:
        need = "logp_prox (call policy_logp first)" if coupled_recompute else "logp_behav (the engine log-probs)"
        raise ValueError(f"old_logp needs TokenBatch.{need}")
    return t


def minibatches(batch: TokenBatch, n: int, *, granularity: int = 1) -> list[TokenBatch]:
    """Split a batch into ``n`` token-balanced minibatches (docs/spec/system.md §7.6); one ``train_step`` each."""
    return [batch.select(rows) for rows in microbatch.minibatches(batch.lengths, n, granularity=granularity)]


def _masked_stats(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.bool()
    return torch.where(m, x.float(), 0.0).sum() / m.sum().clamp(min=1)


def value_loss_fn(cfg: value_lib.ValueConfig = value_lib.ValueConfig()) -> LossFn:
    """Clipped value loss (docs/spec/algorithms.md §12) for ``train_step(..., cfg=StepConfig(module="critic"))``; needs
    ``mb.value_old`` and ``mb.returns``; global token mean."""

    def loss_fn(value: Tensor, mb: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if mb.value_old is None or mb.returns is None:
            raise ValueError("value_loss_fn needs TokenBatch.value_old (critic_values) and .returns (advantages)")
        return value_lib.loss(value, mb.value_old, mb.returns, mb.loss_mask, cfg=cfg, denom=float(mb.n_tokens))

    return loss_fn


def sft_loss_fn(cfg: sft_lib.SFTConfig = sft_lib.SFTConfig()) -> LossFn:
    """Global token-mean NLL on ``loss_mask`` (docs/spec/algorithms.md §13.3), plus the entropy as a metric."""

    def loss_fn(logp: Tensor, mb: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, m = sft_lib.loss(logp, mask=mb.loss_mask, cfg=cfg, denom=float(mb.n_tokens))
        return loss, {**m, "sft/entropy": _masked_stats(mb.entropy.detach(), mb.loss_mask)}

    return loss_fn


def _valid_pairs(mask: Tensor) -> Tensor:
    n = mask.sum(1)
    return (n[0::2] > 0) & (n[1::2] > 0)


def dpo_loss_fn(cfg: dpo_lib.DPOConfig, *, n_pairs: Tensor | float) -> LossFn:
    """DPO / IPO (docs/spec/algorithms.md §13.1) on interleaved pairs; ``n_pairs`` = GLOBAL count of valid pairs (both rows have a
    loss token), e.g. ``global_sum(valid pairs of the local batch)``. Needs ``mb.logp_ref``; micro-batches must
    keep pairs together (``MicroBatchConfig(granularity=2)``)."""

    def loss_fn(logp: Tensor, mb: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if mb.logp_ref is None:
            raise ValueError("dpo_loss_fn needs TokenBatch.logp_ref (ref_logp)")
        lp, n = dpo_lib.sequence_logp(logp, mb.loss_mask)
        lr, _ = dpo_lib.sequence_logp(mb.logp_ref, mb.loss_mask)
        (pc, pr), (rc, rr), (lc, lrj) = dpo_lib.pairs(lp), dpo_lib.pairs(lr), dpo_lib.pairs(n)
        return dpo_lib.loss(pc, pr, rc, rr, cfg=cfg, len_chosen=lc, len_rejected=lrj, denom=float(n_pairs))

    return loss_fn


def rm_loss_fn(*, n_pairs: Tensor | float) -> LossFn:
    """Bradley–Terry reward-model loss (docs/spec/algorithms.md §13.2) on interleaved pairs: the score is the value at the last real
    token; ``n_pairs`` = GLOBAL number of pairs. Use with ``StepConfig(module="critic")`` (or a critic policy slot)."""

    def loss_fn(values: Tensor, mb: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        scores = rm_lib.last_token_scores(values, mb.attention_mask.sum(1).to(values.device))
        sc, sr = dpo_lib.pairs(scores)
        return rm_lib.loss(sc, sr, denom=float(n_pairs))

    return loss_fn



__all__ = [
    "StepConfig", "LossFn",
    "train_step", "with_global_counts", "global_sum", "minibatches",
    "policy_logp", "ref_logp", "teacher_logp", "critic_values", "old_logp",
    "value_loss_fn", "sft_loss_fn", "dpo_loss_fn", "rm_loss_fn", "forward_logp",
    "device_stream",
]

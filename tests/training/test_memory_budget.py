"""``max_tokens_per_mb="auto"`` (rlcore.training.memory_budget): the budget arithmetic, the calibration protocol of
the train step on a pretend GPU, and that none of it changes the gradient.

The pretend GPU (:class:`FakeCuda`) replaces ``memory_budget.read_memory`` / ``reset_peak``: it holds ``base`` bytes
between micro-batches and, through a forward hook on the model, peaks at ``base + per_token · packed tokens`` during
each one. So on a CPU the step really calibrates, really sizes its micro-batches from the pretend free memory, and
the split really changes with it; the loss denominator is global, so the gradient must not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import microbatch
from rlcore.training import memory_budget as mbud
from rlcore.training import step
from rlcore.training import train_state as ts
from rlcore.types import TokenBatch
from tests.training import test_step as common

PER_TOKEN = 10**6  # pretend bytes of activations per packed token
BASE = 10**9  # pretend bytes held between micro-batches


class FakeCuda:
    """A pretend device: ``read``/``reset`` stand in for ``memory_budget.read_memory``/``reset_peak``."""

    def __init__(self, model, *, free_tokens: float, per_token: int = PER_TOKEN, base: int = BASE):
        self.per_token, self.allocated = per_token, base
        self.available = math.ceil(free_tokens * per_token)  # what is free after ``base``
        self.peak, self.resets, self.mb_tokens = base, 0, []
        model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        n = int(args[0].numel())  # the packed token stream of one micro-batch
        self.mb_tokens.append(n)
        self.peak = max(self.peak, self.allocated + self.per_token * n)

    def read(self, device):
        return mbud.MemoryReading(allocated=self.allocated, available=self.available, peak=self.peak)

    def reset(self, device):
        self.peak = self.allocated
        self.resets += 1


def install(monkeypatch, model, **kw) -> FakeCuda:
    fake = FakeCuda(model, **kw)
    monkeypatch.setattr(mbud, "read_memory", fake.read)
    monkeypatch.setattr(mbud, "reset_peak", fake.reset)
    return fake


def state64(seed=0):
    torch.manual_seed(seed)
    st_ = ts.init_train_state(common.tiny_config(), ts.OptimConfig(lr=1e-3), dtype=torch.float64)
    return common.with_sgd(st_)


def auto(**kw) -> step.StepConfig:
    return step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb="auto", **kw), max_grad_norm=0.0)


def unlimited() -> step.StepConfig:
    return step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=None), max_grad_norm=0.0)


def token_batch(seed=4, n=8):
    tb = TokenBatch.from_rollout(common.make_batch(seed, n=n))
    adv = torch.randn(tb.input_ids.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return dataclasses.replace(tb, logp_prox=tb.logp_behav.double(), adv=torch.where(tb.loss_mask, adv, 0.0))


def delta_of(st_, tb, cfg):
    before = common.params(st_.model)
    st2, m = step.train_step(st_, tb, common.ppo_loss_fn(), cfg=cfg)
    return st2, m, {k: v - before[k] for k, v in common.params(st_.model).items()}


def assert_close(d, ref):
    assert max(float(v.abs().max()) for v in ref.values()) > 1e-6  # not vacuous
    for k in ref:
        assert torch.allclose(d[k], ref[k], atol=1e-12, rtol=1e-9), k


# ----------------------------------------------------------------------------------------------------------
# the budget arithmetic (pure)
# ----------------------------------------------------------------------------------------------------------

slope_st = st.floats(1.0, 1e7, allow_nan=False, allow_infinity=False)
avail_st = st.integers(0, 2**40)
frac_st = st.floats(0.05, 1.0)
round_st = st.sampled_from([1, 8, 256, 1024])


def _raw(slope, avail, reserve, frac):
    usable = frac * avail - reserve
    return int(usable // slope) if usable > 0 else 0


@given(slope_st, avail_st, avail_st, st.integers(0, 2**20), st.integers(0, 2**30), frac_st, round_st)
def test_budget_monotone_in_free_memory_and_within_bounds(slope, a1, a2, longest, reserve, frac, round_to):
    lo, hi = sorted((a1, a2))
    got = []
    for avail in (lo, hi):
        raw = _raw(slope, avail, reserve, frac)
        if raw < longest:
            with pytest.raises(ValueError, match="max_tokens_per_mb"):
                mbud.budget_tokens(slope, avail, longest=longest, reserve=reserve, fraction=frac, round_to=round_to)
            got.append(None)
            continue
        b = mbud.budget_tokens(slope, avail, longest=longest, reserve=reserve, fraction=frac, round_to=round_to)
        assert longest <= b <= raw  # never below the longest sequence, never more than fits
        assert b * slope <= frac * avail - reserve + slope  # fits (up to the float floor)
        assert b % round_to == 0 or b == longest or b < round_to  # rounded down to the unit
        got.append(b)
    if got[0] is not None:  # more free memory never gives a smaller budget (nor an error)
        assert got[1] is not None and got[1] >= got[0]


@given(slope_st, st.integers(1, 2**16), frac_st)
def test_budget_errors_exactly_when_the_longest_sequence_does_not_fit(slope, longest, frac):
    fits = int(math.ceil(longest * slope / frac)) + 1  # bytes that hold `longest` tokens
    assert mbud.budget_tokens(slope, fits, longest=longest, fraction=frac) >= longest
    with pytest.raises(ValueError, match=r"max_tokens_per_mb.*int max_tokens_per_mb >= "):
        mbud.budget_tokens(slope, int(longest * slope / frac * 0.5), longest=longest, fraction=frac)


@given(st.lists(st.integers(1, 64), min_size=0, max_size=24), st.integers(1, 200), st.sampled_from([1, 2]))
def test_calibration_rows_are_the_smallest_groups_within_the_tokens(lengths, tokens, g):
    lengths = lengths[: len(lengths) // g * g]
    rows = microbatch.calibration_rows(lengths, tokens, granularity=g)
    assert rows == sorted(set(rows)) and (bool(rows) == bool(lengths))
    assert all(r // g * g + j in rows for r in rows for j in range(g))  # whole groups
    sizes = {u: sum(lengths[u * g : u * g + g]) for u in range(len(lengths) // g)}
    picked = {r // g for r in rows}
    if len(picked) > 1:
        assert sum(sizes[u] for u in picked) <= tokens
    if picked:  # nothing left out is smaller than something taken
        assert max(sizes[u] for u in picked) <= min((sizes[u] for u in sizes if u not in picked), default=math.inf)


def test_config_and_allocate_reject_what_they_cannot_mean():
    assert microbatch.MicroBatchConfig().max_tokens_per_mb == "auto"  # the default
    for bad in (0, "big", 2.5, True):
        with pytest.raises(ValueError, match="max_tokens_per_mb"):
            microbatch.MicroBatchConfig(max_tokens_per_mb=bad)
    with pytest.raises(ValueError, match="memory_fraction"):
        microbatch.MicroBatchConfig(memory_fraction=0.0)
    with pytest.raises(ValueError, match="auto.*train step"):
        microbatch.allocate([3, 4], microbatch.MicroBatchConfig())  # unresolved "auto" never reaches the allocator
    assert microbatch.minibatches([3, 4, 5, 6], 2) == microbatch.allocate(
        [3, 4, 5, 6], microbatch.MicroBatchConfig(max_tokens_per_mb=None, n_mbs=2))


# ----------------------------------------------------------------------------------------------------------
# CPU: "auto" is None, exactly; int and None are what they were
# ----------------------------------------------------------------------------------------------------------


def test_cpu_auto_equals_unlimited_exactly():
    tb = token_batch()
    runs = []
    for cfg in (auto(), unlimited()):
        st_, m, d = delta_of(state64(), tb, cfg)
        runs.append((m, d))
        assert float(m["train/n_microbatches"]) == 1.0 and "train/mb_tokens_budget" not in m
    (ma, da), (mn, dn) = runs
    assert float(ma["train/loss"]) == float(mn["train/loss"])
    assert all(torch.equal(da[k], dn[k]) for k in dn)
    assert mbud.slopes(state64().model) == mbud.Slopes()  # nothing measured on a CPU


def test_int_budget_is_reported_and_allocates_as_before():
    tb = token_batch()
    cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=20), max_grad_norm=0.0)
    _, m, _ = delta_of(state64(), tb, cfg)
    assert float(m["train/mb_tokens_budget"]) == 20.0
    assert float(m["train/n_microbatches"]) == len(microbatch.allocate(tb.lengths, cfg.mb)) > 1


# ----------------------------------------------------------------------------------------------------------
# "auto" on the pretend GPU
# ----------------------------------------------------------------------------------------------------------


def test_auto_splits_by_free_memory_and_keeps_the_gradient(monkeypatch):
    """Calibration step, then a measured-slope step: both split into several micro-batches sized from the pretend
    free memory, and both gradients equal the one-micro-batch gradient."""
    tb = token_batch()
    _, m_ref, ref = delta_of(state64(), tb, unlimited())
    st_ = state64()
    fake = install(monkeypatch, st_.model, free_tokens=24 / 0.9)
    cfg = auto(calibration_tokens=10)
    st_, m1, d1 = delta_of(st_, tb, cfg)
    assert fake.resets > 0 and mbud.slopes(st_.model).train == PER_TOKEN  # measured in this step
    assert_close(d1, ref)
    # calibration: 2 micro-batches of <= 10 tokens (the smallest rows first), then the rest under the budget
    assert all(n <= 10 for n in fake.mb_tokens[:2]) and float(m1["train/mb_tokens_budget"]) == 24
    assert float(m1["train/n_microbatches"]) == len(fake.mb_tokens) > 3
    # second step: no calibration, every micro-batch within the budget from the measured slope
    fake.resets, fake.mb_tokens = 0, []
    reserve = mbud.missing_grad_bytes(st_.model)
    want = mbud.budget_tokens(PER_TOKEN, fake.available, longest=max(tb.lengths), reserve=reserve)
    p1 = common.params(st_.model)
    st_, m2, d2 = delta_of(st_, tb, cfg)
    assert fake.resets == 0 and float(m2["train/mb_tokens_budget"]) == want
    assert max(fake.mb_tokens) <= want and len(fake.mb_tokens) == float(m2["train/n_microbatches"]) > 1
    resolved = dataclasses.replace(cfg.mb, max_tokens_per_mb=want)
    assert len(fake.mb_tokens) == len(microbatch.allocate(tb.lengths, resolved))
    for k, v in st_.model.named_parameters():  # the same step from the same weights, one micro-batch (SGD: stateless)
        v.data.copy_(p1[k])
    _, m2_ref, d2_ref = delta_of(st_, tb, unlimited())
    assert_close(d2, d2_ref)
    assert abs(float(m2["train/loss"]) - float(m2_ref["train/loss"])) < 1e-12
    assert abs(float(m1["train/loss"]) - float(m_ref["train/loss"])) < 1e-12


def test_the_knob_moves_the_split(monkeypatch):
    """More pretend free memory -> a larger budget and fewer micro-batches (after calibration); enough -> one."""
    tb = token_batch()
    counts, budgets = [], []
    for free in (16, 32, 64, 10**6):
        st_ = state64()
        install(monkeypatch, st_.model, free_tokens=free / 0.9 + 0.5)
        st_, _, _ = delta_of(st_, tb, auto(calibration_tokens=10))  # calibrates
        _, m, _ = delta_of(st_, tb, auto(calibration_tokens=10))
        counts.append(float(m["train/n_microbatches"]))
        budgets.append(float(m["train/mb_tokens_budget"]))
    assert budgets == sorted(budgets) and len(set(budgets)) == 4
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[1] and counts[-1] == 1.0


def test_rl_update_with_auto_forward_and_train_slopes(monkeypatch):
    """A whole RL step (no-grad proximal forward + train step) under "auto": both slopes measured, once each; the
    update equals the unlimited one."""
    batch = common.make_batch(4, n=8)
    st_ = state64()
    before = common.params(st_.model)
    common.rl_update(st_, batch, scfg=unlimited())
    ref = {k: v - before[k] for k, v in common.params(st_.model).items()}
    st_ = state64()
    fake = install(monkeypatch, st_.model, free_tokens=22)
    before = common.params(st_.model)
    _, m = common.rl_update(st_, batch, scfg=auto(calibration_tokens=12))
    assert_close({k: v - before[k] for k, v in common.params(st_.model).items()}, ref)
    rec = mbud.slopes(st_.model)
    assert rec.train == rec.forward == PER_TOKEN and float(m["train/n_microbatches"]) > 2
    fake.resets = 0
    common.rl_update(st_, batch, scfg=auto(calibration_tokens=12))
    assert fake.resets == 0  # neither pass calibrates again
    mbud.clear(st_.model)
    assert mbud.slopes(st_.model) == mbud.Slopes()


def test_data_parallel_contract(monkeypatch):
    """Another rank needing one more micro-batch (sync_num_mbs) makes this rank run one more too, and the slope
    kept is the max over ranks (sync_max): every rank then sizes and counts alike. The gradient is unchanged."""
    tb = token_batch()
    _, _, ref = delta_of(state64(), tb, unlimited())
    counts = []
    for extra in (0, 1):
        st_ = state64()
        fake = install(monkeypatch, st_.model, free_tokens=30)
        monkeypatch.setattr(microbatch, "sync_num_mbs", lambda n, group=None, e=extra: n + e)
        monkeypatch.setattr(microbatch, "sync_max", lambda n, group=None: max(n, 3 * PER_TOKEN))
        st_, m, d = delta_of(st_, tb, auto(calibration_tokens=10))
        assert_close(d, ref)
        assert float(m["train/n_microbatches"]) == len(fake.mb_tokens)  # one backward per micro-batch
        assert mbud.slopes(st_.model).train == 3 * PER_TOKEN
        counts.append(len(fake.mb_tokens))
    assert counts[1] == counts[0] + 1  # the calibration count is fixed; the rest follows the synced count


def test_auto_raises_when_one_sequence_cannot_fit(monkeypatch):
    tb = token_batch()
    st_ = state64()
    install(monkeypatch, st_.model, free_tokens=max(tb.lengths) - 1)
    with pytest.raises(ValueError, match=r"max_tokens_per_mb='auto'.*longest sequence"):
        step.train_step(st_, tb, common.ppo_loss_fn(), cfg=auto(calibration_tokens=6))


def test_a_batch_within_one_calibration_micro_batch_measures_nothing(monkeypatch):
    """Too few tokens to measure a gradient-free micro-batch: the step runs (the second calibration micro-batch
    is zero-weight), keeps no slope, and the next step calibrates again."""
    tb = token_batch(n=3)
    _, _, ref = delta_of(state64(), tb, unlimited())
    st_ = state64()
    fake = install(monkeypatch, st_.model, free_tokens=100)
    st_, m, d = delta_of(st_, tb, auto(calibration_tokens=1000))
    assert_close(d, ref)
    assert float(m["train/n_microbatches"]) == 2 and mbud.slopes(st_.model).train is None
    fake.resets = 0
    delta_of(st_, tb, auto(calibration_tokens=1000))
    assert fake.resets > 0

"""``step.device_stream``: an update's CUDA work on a high-priority stream of its own.

On one GPU shared with an engine thread (default stream), the whole update (proximal forward, advantages,
``train_step``) in one high-priority block lets the engine's kernels fill its gaps: bench_trl η = 4 / η = 0 gave
1.23, 1.10, 1.45, 1.15 against 1.07, 1.12, 1.15, 1.16 on one stream (docs/benchmarks.md). On CPU the
block changes nothing; the CUDA tests check that the work really runs on that stream, that the result equals the
one-stream update, and that what the block updates in place is complete when it returns (an engine in another
stream reads it next).
"""

import pytest
import torch

from rlcore import advantages
from rlcore.training import step
from rlcore.training import train_state as ts
from tests.training.test_step import make_batch, params, ppo_loss_fn, rl_update, tiny_config, with_sgd

CUDA = torch.cuda.is_available()
ADV = advantages.GRPO


def test_mode_is_validated_by_name():
    with pytest.raises(ValueError, match="device_stream mode"):
        with step.device_stream(torch.device("cpu"), "fast"):  # type: ignore[arg-type]
            pass


def _update(device: str, mode: str) -> tuple[list, dict, dict]:
    """One RL update (proximal forward, advantages, train_step) inside ``device_stream``; the streams ``loss_fn``
    ran on, the parameters after, the metrics."""
    torch.manual_seed(0)
    state = with_sgd(ts.init_train_state(tiny_config(), ts.OptimConfig(), device=device))  # update = -grad
    seen: list = []
    inner = ppo_loss_fn()

    def loss_fn(logp, mb):
        seen.append(torch.cuda.current_stream() if logp.is_cuda else None)
        return inner(logp, mb)

    with step.device_stream(torch.device(device), mode):  # type: ignore[arg-type]
        state, m = rl_update(state, make_batch(5, stale=True), loss_fn, adv_cfg=ADV)
    # no synchronize here: the block itself must leave its in-place updates complete
    return seen, params(state.model), m


def test_cpu_block_runs_the_update_without_touching_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("device_stream touched CUDA streams for a CPU device")

    class NoStream(torch.cuda.Stream):  # a class still, so annotations like ``Stream | None`` keep working
        def __new__(cls, *args, **kwargs):
            no_cuda()

    monkeypatch.setattr(torch.cuda, "Stream", NoStream)
    monkeypatch.setattr(torch.cuda, "stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    torch.manual_seed(0)
    before = params(ts.init_train_state(tiny_config(), ts.OptimConfig(), device="cpu").model)
    _, after, m = _update("cpu", "high_priority")
    assert float(m["train/update_successful"]) == 1.0
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the update ran inside the block


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_update_runs_on_a_high_priority_stream_and_equals_the_one_stream_update():
    hi = torch.cuda.Stream.priority_range()[1]
    seen_hi, got, m_hi = _update("cuda", "high_priority")
    seen_cur, want, m_cur = _update("cuda", "current")
    assert seen_hi and all(s.priority == hi and s != torch.cuda.default_stream() for s in seen_hi)
    assert seen_cur and all(s == torch.cuda.default_stream() for s in seen_cur)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # restored after the block
    # same kernels, same order; only atomics (embedding backward) may differ in the last bits
    torch.testing.assert_close(m_hi["train/loss"], m_cur["train/loss"], rtol=1e-5, atol=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_block_waits_for_the_callers_queue_and_finishes_before_returning():
    # inputs queued on the caller's stream are ready inside; results are complete for another stream afterwards
    src = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the caller's stream busy before the fill below lands
    src.fill_(3.0)
    with step.device_stream(torch.device("cuda")):
        out = src * 2
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        total = out.sum()
    other.synchronize()
    assert float(total) == 6.0 * src.numel()

"""rlcore.training.curve: the evaluation curve of a run, inline or through an evaluation child."""

from __future__ import annotations

import torch

from rlcore.training import curve as curve_lib


class Logger:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, step, m):
        self.rows.append((step, dict(m)))


class Child:
    """A stand-in for BackgroundEval: scores each submission with its step / 10 when asked for results."""

    def __init__(self):
        self.pending: list = []

    def submit(self, tag, model):
        self.pending.append(tag)

    def results(self, wait=False):
        done, self.pending = [(tag, tag[1] / 10) for tag in self.pending], []
        return done


def test_inline_curve_scores_on_schedule_and_once_more_at_the_end():
    scores = iter([0.1, 0.2, 0.3, 0.4])
    log = Logger()
    c = curve_lib.Curve(lambda m: next(scores), log, every_s=10.0)
    model = torch.nn.Linear(2, 2)
    c.start(0, model)
    assert c.due(5.0, 1, model) == {}  # not yet
    assert c.due(10.0, 2, model) == {"eval/greedy_success": 0.2}
    assert c.due(15.0, 3, model) == {}
    c.finish(16.0, 3, model)  # the final step was not evaluated yet
    c.finish(16.0, 3, model)  # ... and only once
    assert [(s, g) for _, s, g in c.hist] == [(0, 0.1), (2, 0.2), (3, 0.3)]
    assert log.rows == [(0, {"eval/greedy_success": 0.1}), (3, {"eval/greedy_success": 0.3})]
    out = c.summary()
    assert out["greedy_success_start"] == 0.1 and abs(out["greedy_success_end"] - 0.2) < 1e-12
    assert abs(out["greedy_success_gain"] - 0.1) < 1e-12


def test_child_curve_submits_copies_and_logs_their_scores_in_order():
    log, child = Logger(), Child()
    c = curve_lib.Curve(lambda m: 0.5, log, every_s=0.0, child=child)
    model = torch.nn.Linear(2, 2)
    c.start(0, model)
    for step in (1, 2):
        assert c.due(float(step), step, model) == {}  # the score arrives later, through collect
        c.collect()
    c.finish(3.0, 2, model)  # step 2 was submitted already: nothing new
    assert [(s, g) for _, s, g in c.hist] == [(0, 0.5), (1, 0.1), (2, 0.2)]
    assert [s for s, _ in log.rows] == [0, 1, 2]


def test_staleness_counts_generated_tokens_only():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    versions = torch.tensor([[3, 1, -1], [-1, 2, 0]])
    m = curve_lib.staleness(mask, versions, 4)
    assert float(m["version_stats/staleness_max"]) == 3.0  # token (0, 1); (0, 2) and (1, 2) are masked out
    assert float(m["version_stats/staleness_mean"]) == 2.0  # (1 + 3) / 2; a prompt token (-1) does not count

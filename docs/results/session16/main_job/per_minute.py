"""Per-minute cores busy, trainer cores and informative groups of one tiny_cpu run, from its TensorBoard log:

    python docs/results/session16/main_job/per_minute.py LOG_DIR

``perf/cores_busy`` is cumulative (CPU seconds of all processes / wall since the start), so each minute's value is
the difference of cumulative CPU seconds over the difference of ``time/elapsed_s``.
"""

import statistics
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
    ea.Reload()

    def series(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in ea.Scalars(tag)} if tag in ea.Tags()["scalars"] else {}

    cores, trainer, elapsed = series("perf/cores_busy"), series("perf/cores_busy_trainer"), series("time/elapsed_s")
    informative, tokens = series("rollout/informative_groups"), series("ppo_actor/n_tokens")
    steps = sorted(set(cores) & set(elapsed))
    prev = steps[0]
    for minute in range(1, 11):
        cur = min(steps, key=lambda s: abs(elapsed[s] - 60 * minute))
        dt = elapsed[cur] - elapsed[prev]
        if dt <= 0:
            continue
        busy = (cores[cur] * elapsed[cur] - cores[prev] * elapsed[prev]) / dt
        tr = (trainer[cur] * elapsed[cur] - trainer[prev] * elapsed[prev]) / dt
        window = [s for s in steps if elapsed[prev] < elapsed[s] <= elapsed[cur]]
        inf = statistics.mean(informative[s] for s in window if s in informative)
        tok = statistics.mean(tokens[s] for s in window if s in tokens)
        print(f"{elapsed[prev]:5.0f}-{elapsed[cur]:5.0f} s: {cur - prev:4d} steps, cores {busy:.3f}, trainer {tr:.3f}, "
              f"informative groups {inf:.1f} of 32, tokens per step {tok:.0f}")
        prev = cur


if __name__ == "__main__":
    main()

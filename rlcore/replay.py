"""``rlcore-replay DIR`` (= ``python -m rlcore.replay DIR``): re-run a recorded run's training, with no engine.

A run started with ``--record DIR`` (``rlcore.training.record``) stored the config, the initial weights' hash and,
per train step, the batch it consumed, the weight version it started from and the RNG state. Replay imports the
recorded experiment file, rebuilds the initial state with its ``init_state(cfg)``, checks the initial weights'
sha256, and feeds every recorded batch through its ``train_batch(state, batch, loss_fn, cfg)`` with the loss of
``build_loss_fn(cfg)``. It prints each step's loss and the final weights' sha256 and, on CPU with the same torch
build and thread count, reproduces them bit for bit: it exits 1 at the first difference, naming the step and the
tensor (loss, a parameter, or a record tensor that no longer matches its hash).

``--objective`` trains another objective on the identical samples (a controlled ablation: the sampling noise is
gone, only the loss differs); nothing is compared then. From Python: ``replay(dir, loss_fn=my_loss_fn)``.

A record is data, never code: the whole record is checked before anything runs (regular files of the record
directory only, every field typed and bounded, config classes from an allow-list), and the experiment file it
names is imported only when it lies in this checkout's ``experiments/`` directory; any other file runs only when
the caller names it with ``--experiment``. Exit codes: 0 match, 1 mismatch, 2 bad input, 3 the experiment raised.

Run:    python -m rlcore.replay /tmp/rec
        python -m rlcore.replay /tmp/rec --objective gspo            # or MODULE:FUNCTION / FILE.py:FUNCTION
Format and guarantees: docs/replay.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import stat
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import torch
import tyro

from rlcore.training import record
from rlcore.training import step as step_lib
from rlcore.training.step import LossFn

REQUIRED = ("init_state", "build_loss_fn", "train_batch")
"""Functions a replayable experiment file defines (experiments/tiny_cpu.py has all three)."""


@dataclass(frozen=True)
class ReplayArgs:
    """Re-run a recorded run's training from its record directory, no engine; compare bit for bit."""

    record: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="DIR")]
    """Record directory written by an experiment's ``--record DIR``."""
    objective: str = ""
    """Ablation: train another objective on the same samples instead of the run's own loss (nothing is compared).
    An objective name (ppo, grpo, dapo, gspo, sapo, cispo; default config) or
    MODULE:FUNCTION / FILE.py:FUNCTION, a function of the recorded config returning a loss_fn(logp, mb)."""
    experiment: str = ""
    """Experiment file to import instead of the recorded path: a record moved to another checkout, or one naming a
    file outside this checkout's experiments/ (which replay never imports on the record's word)."""
    threads: int = 0
    """torch CPU threads, at most 1024; 0 uses the recorded count (bit-for-bit needs the same count)."""


class ReplayMismatch(Exception):
    """The replay differs from the record; ``step`` is the train step (None: the initial weights)."""

    def __init__(self, step: int | None, what: str):
        self.step, self.what = step, what
        super().__init__(f"step {step}: {what}" if step is not None else what)


@dataclass(frozen=True)
class ReplayResult:
    """Per trained step (in order): ``steps`` and their ``losses``; ``sha256`` of the final weights; ``checked``
    is True when every loss and hash was compared with the record (the run's own loss), False for an ablation."""

    steps: list[int]
    losses: list[float]
    sha256: str
    checked: bool


EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_EXPERIMENT_FAILED = 0, 1, 2, 3
"""``rlcore-replay``'s exit codes (docs/replay.md)."""


class ExperimentFailed(Exception):
    """The experiment's own code raised while replaying (``step`` None: while building the initial state)."""

    def __init__(self, step: int | None, err: BaseException):
        self.step, self.err = step, err
        where = f"step {step}" if step is not None else "init_state/build_loss_fn"
        super().__init__(f"the experiment raised at {where}: {type(err).__name__}: {err}")


def trusted_experiments_dir() -> Path:
    """``experiments/`` of the checkout this rlcore was imported from: the only place a record's own
    ``experiment.file`` is imported from (any other file needs ``--experiment``)."""
    return Path(__file__).resolve().parent.parent / "experiments"


def recorded_experiment(header: dict[str, Any]) -> Path:
    """The experiment file ``record.json`` names, if it lies in :func:`trusted_experiments_dir`; else ValueError
    naming the file and the fix (the record cannot choose code to run)."""
    named = header["experiment"]["file"]
    trusted = trusted_experiments_dir().resolve()
    path = Path(named)
    resolved = path.resolve() if path.is_absolute() else None
    if resolved is None or resolved.parent != trusted or resolved.suffix != ".py":
        raise ValueError(
            f"record.json names the experiment file {named!r:.200}, which is not in {trusted}; replay imports a "
            "record's experiment only from there (a record is data and never chooses code to run): pass "
            "--experiment PATH if you trust that file")
    return resolved


def load_experiment(path: str | Path) -> ModuleType:
    """Import an experiment file under a private module name and check it defines :data:`REQUIRED`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file {str(path)!r} not found; pass --experiment PATH to the file")
    name = f"rlcore_replay_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    missing = [f for f in REQUIRED if not callable(getattr(mod, f, None))]
    if missing:
        raise AttributeError(
            f"{path} has no {missing}; a replayable experiment defines init_state(cfg), build_loss_fn(cfg) and "
            "train_batch(state, batch, loss_fn, cfg) (see experiments/tiny_cpu.py)"
        )
    return mod


def _default_objective(name: str) -> Any:
    """The default config (a callable objective value) that the command-line name ``name`` stands for."""
    from rlcore.objectives import cispo, gspo, ppo, sapo

    names = {"ppo": ppo.PPOConfig, "grpo": ppo.PPOConfig, "dapo": ppo.DAPOConfig, "gspo": gspo.GSPOConfig,
             "sapo": sapo.SAPOConfig, "cispo": cispo.CISPOConfig}
    if name not in names:
        raise ValueError(f"--objective {name!r} is not one of {sorted(names)}; or pass MODULE:FUNCTION")
    return names[name]()


def objective_loss_fn(name: str) -> LossFn:
    """A ``loss_fn(logp, mb)`` of the objective ``name`` (ppo, grpo, dapo, gspo, sapo, cispo) at its default config
    and the global denominator of its aggregation; needs ``mb.logp_behav`` and ``mb.adv`` (all ``(b t)``), and
    ``mb.logp_prox`` unless the proximal weights are the ones the step starts from (``step.proximal_logp``)."""
    obj = _default_objective(name)

    def loss_fn(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        missing = [k for k in ("logp_behav", "adv") if getattr(mb, k) is None]
        if missing:
            raise ValueError(f"--objective {name}: the experiment's train_batch leaves TokenBatch.{missing} unset")
        prox = step_lib.proximal_logp(logp, mb)  # unset: this forward's weights, the ones the step starts from
        return obj(logp, prox, mb.logp_behav, mb.adv, mb.loss_mask, denom=mb.denom(obj.agg))

    return loss_fn


def resolve_objective(spec: str, cfg: Any) -> LossFn:
    """``--objective``: an objective name, or ``MODULE:FUNCTION`` / ``FILE.py:FUNCTION`` called with ``cfg``."""
    if ":" not in spec:
        return objective_loss_fn(spec)
    where, fn_name = spec.rsplit(":", 1)
    mod = _import_file(where) if where.endswith(".py") else importlib.import_module(where)
    builder = getattr(mod, fn_name, None)
    if not callable(builder):
        raise AttributeError(f"--objective {spec!r}: {where} has no function {fn_name!r}")
    return builder(cfg)


def _import_file(path: str) -> ModuleType:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--objective: file {path!r} not found")
    spec = importlib.util.spec_from_file_location(f"rlcore_replay_objective_{p.stem}", p)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[mod.__name__] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def replay(
    root: str | Path,
    *,
    loss_fn: LossFn | None = None,
    objective: str = "",
    experiment: str = "",
    threads: int = 0,
    out: Callable[[str], None] = print,
) -> ReplayResult:
    """Re-run the record in ``root``; raise :class:`ReplayMismatch` at the first difference.

    With ``loss_fn`` (or ``objective``, see :class:`ReplayArgs`) the same batches train that loss instead and
    nothing but the initial weights is compared. ``out`` receives one line per trained step and the final hash.
    """
    # the whole record is checked before any code runs: fields, file names, regular files
    header = record.read_header(root)
    entries = record.read_entries(root)
    for e in entries:
        if e["file"] is not None:
            path = record.step_path(root, e)
            try:
                st = path.lstat()
            except FileNotFoundError:
                raise record.RecordInvalid(f"{path}: the step file of entry {e['entry']} is missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise record.RecordInvalid(f"{path}: the step file of entry {e['entry']} is not a regular file "
                                           "(a symlink, FIFO, device or directory)")
    final = record.read_final(root)
    n_threads = threads or int(header["threads"])
    if not 1 <= n_threads <= record.MAX_THREADS:
        raise ValueError(f"--threads {threads} must be in [1, {record.MAX_THREADS}] (or 0 for the recorded count)")
    exp_path = Path(experiment) if experiment else recorded_experiment(header)
    if exp_path.exists() and not exp_path.is_file():
        raise ValueError(f"experiment file {str(exp_path)!r} is not a regular file")
    if header["torch"] != torch.__version__:
        out(f"warning: recorded with torch {header['torch']}, replaying with {torch.__version__}; "
            "bit-for-bit holds only for the same torch build")
    mod = load_experiment(exp_path)
    cfg = record.config_from_json(header["config"], experiment=mod)
    torch.set_num_threads(n_threads)
    try:
        state = mod.init_state(cfg)
    except Exception as e:  # noqa: BLE001 - the experiment's own code: reported with its traceback, exit 3
        raise ExperimentFailed(None, e) from e
    digest, per = record.weights_sha256(state.model)
    if digest != header["initial_weights"]["sha256"]:
        name = record.first_difference(header["initial_weights"]["tensors"], per)
        raise ReplayMismatch(None, f"initial weights differ from the record in tensor '{name}' (model directory changed?)")
    checked = loss_fn is None and not objective
    if loss_fn is None and objective:
        loss_fn = resolve_objective(objective, cfg)
    elif loss_fn is None:
        try:
            loss_fn = mod.build_loss_fn(cfg)
        except Exception as e:  # noqa: BLE001
            raise ExperimentFailed(None, e) from e
    steps: list[int] = []
    losses: list[float] = []
    for e in entries:
        if e["file"] is None:
            continue  # a rollout batch that trained nothing (every group filtered)
        if state.step != e["step"]:
            raise ReplayMismatch(e["step"], f"the record is not contiguous: replay is at step {state.step}")
        batch, rng = record.load_step(root, e)
        if rng is not None:
            torch.set_rng_state(rng)
        state = dataclasses.replace(state, version=int(e["version"]))
        try:
            state, m = mod.train_batch(state, batch, loss_fn, cfg)
            loss = float(m["train/loss"])
        except Exception as e2:  # noqa: BLE001 - e.g. a recorded batch of shapes the experiment cannot train
            raise ExperimentFailed(e["step"], e2) from e2
        steps.append(e["step"])
        losses.append(loss)
        verdict = ""
        if checked and "loss" in e:
            if loss.hex() != e["loss"]:
                raise ReplayMismatch(e["step"], f"tensor 'train/loss' differs: recorded {e['loss_value']!r} "
                                                f"({e['loss']}), replayed {loss!r} ({loss.hex()})")
            verdict = "  ok"
        if checked and "weights" in e:
            d, p = record.weights_sha256(state.model)
            if d != e["weights_sha256"]:
                raise ReplayMismatch(e["step"], f"weights after the step differ in tensor "
                                                f"'{record.first_difference(e['weights'], p)}'")
        out(f"step {e['step']:6d}  version {e['version']:6d}  rows {e['rows']:4d}  loss {loss:+.9e} "
            f"({loss.hex()}){verdict}")
    digest, per = record.weights_sha256(state.model)
    if checked and final is not None and final["weights_sha256"] != digest:
        raise ReplayMismatch(state.step, f"final weights differ in tensor '{record.first_difference(final['weights'], per)}'")
    out(f"final weights sha256 {digest}" + ("  (matches the record)" if checked and final is not None else ""))
    return ReplayResult(steps=steps, losses=losses, sha256=digest, checked=checked)


def main(args: ReplayArgs) -> int:
    """Run :func:`replay` and map the outcome to an exit code (docs/replay.md):

    - 0 (``EXIT_OK``): everything matches, or an ablation ran;
    - 1 (``EXIT_MISMATCH``): the first difference: a replayed loss or weight, or a record tensor that no longer
      matches its hash (``MISMATCH at step N: ...``);
    - 2 (``EXIT_BAD_INPUT``): no record there, a malformed or unsafe record (the file, line and field are named),
      an experiment file that is missing or not in this checkout's experiments/ (pass ``--experiment``), bad
      arguments;
    - 3 (``EXIT_EXPERIMENT_FAILED``): the experiment's own code raised (its traceback is printed).
    """
    try:
        replay(args.record, objective=args.objective, experiment=args.experiment, threads=args.threads)
    except (ReplayMismatch, record.RecordCorrupt) as e:
        print(f"replay: MISMATCH at {e}", file=sys.stderr, flush=True)
        return EXIT_MISMATCH
    except ExperimentFailed as e:
        traceback.print_exception(e.err, file=sys.stderr)
        print(f"replay: {e}", file=sys.stderr, flush=True)
        return EXIT_EXPERIMENT_FAILED
    except (FileNotFoundError, ValueError, AttributeError, ImportError, KeyError, OSError) as e:
        print(f"replay: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return EXIT_OK


def cli(argv: list[str] | None = None) -> None:
    """``rlcore-replay``: tyro over :class:`ReplayArgs` (``argv`` default ``sys.argv[1:]``), exit code of ``main``."""
    args = tyro.cli(ReplayArgs, args=argv, prog="rlcore-replay", description=__doc__)
    sys.exit(main(args))


if __name__ == "__main__":
    cli()

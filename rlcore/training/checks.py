"""Config checks the experiments share, so that a bound is written once and every message names the field and
the flag that fixes it (``--field-name``): ``checks.at_least(self, 1, "steps", "group_size")`` in a frozen
config's ``__post_init__``."""

from __future__ import annotations

from pathlib import Path


def flag(name: str) -> str:
    """The command-line flag of a config field (tyro's spelling)."""
    return "--" + name.replace("_", "-")


def at_least(cfg: object, minimum: float, *names: str, why: str = "") -> None:
    """Each field ``names`` of ``cfg`` must be >= ``minimum`` (NaN fails too); ``why`` says what the bound means."""
    for name in names:
        value = getattr(cfg, name)
        if not value >= minimum:
            note = f" ({why})" if why else ""
            raise ValueError(f"{type(cfg).__name__}.{name} must be >= {minimum}{note}, got {value!r}; pass "
                             f"{flag(name)} {minimum} or more")


def above(cfg: object, bound: float, *names: str, why: str = "") -> None:
    """Each field ``names`` of ``cfg`` must be > ``bound`` (NaN fails too)."""
    for name in names:
        value = getattr(cfg, name)
        if not value > bound:
            note = f" ({why})" if why else ""
            raise ValueError(f"{flag(name)} must be > {bound}{note}, got {value!r} ({type(cfg).__name__}.{name})")


def fits(cfg: object, names: tuple[str, ...], limit: int, limit_flag: str) -> None:
    """The fields ``names`` together must fit in ``limit`` (the flag ``limit_flag`` raises it)."""
    need = sum(getattr(cfg, n) for n in names)
    if need > limit:
        parts = " + ".join(f"{flag(n)} {getattr(cfg, n)}" for n in names)
        lower = " or ".join(flag(n) for n in names)
        raise ValueError(f"{parts} = {need} exceeds {limit_flag} {limit}; lower {lower}, or raise {limit_flag}")


def needs(cfg: object, name: str, other: str, metavar: str = "VALUE") -> None:
    """A truthy field ``name`` needs the field ``other`` set (``metavar``: what the message says to pass)."""
    if getattr(cfg, name) and not getattr(cfg, other):
        owner = type(cfg).__name__
        raise ValueError(f"{owner}.{name} needs {owner}.{other}; pass {flag(other)} {metavar}")


def model_dir(cfg: object, name: str, fix: str) -> None:
    """The field ``name`` must be a local HF model directory (with config.json); ``fix`` says what to pass."""
    path = getattr(cfg, name)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{type(cfg).__name__}.{name}={path!r} is not a local HF model directory (no config.json); "
                         f"{fix}")


__all__ = ["flag", "at_least", "above", "fits", "needs", "model_dir"]

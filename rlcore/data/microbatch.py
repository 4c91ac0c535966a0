"""Micro-batch and minibatch allocation under a token budget (docs/spec/system.md §7.1, §7.3, §7.6).

Everything here works on Python lists of sequence lengths (host-side bookkeeping, not leaf math) and
returns lists of row indices, sorted within each bin. Two allocators:

* ``ffd``: first-fit-decreasing flavoured greedy. ``k = max(n_mbs, ceil(Σl / budget))`` bins are
  opened up front, items are placed largest first into the **least-loaded bin that still fits**, and a
  new bin opens when none fits. rlcore picks the least-loaded bin (AReaL picks the bin with fewest
  items) because that is LPT scheduling: without a budget the largest bin holds at most
  ``Σl/k + max l ≤ OPT + max l`` tokens.
* ``kk``: Karmarkar–Karp largest differencing into ``k`` sets; falls back to ``ffd`` if a set breaks
  the budget.

``granularity`` keeps that many adjacent rows together (DPO/RM pairs: 2). ``attn_weight`` adds
``attn_weight · l²`` to the balancing cost so attention-heavy long sequences spread out; the budget
is always checked on tokens.

The default budget ``max_tokens_per_mb="auto"`` needs a device to mean anything, so :func:`allocate` never sees
it: the train step resolves it first (``rlcore.training.memory_budget``: the largest budget whose activations
fit the free CUDA memory; unlimited on CPU). :func:`calibration_rows` picks the small first micro-batches that
measurement runs on, and :func:`sync_max` makes every data-parallel rank agree on what it measured.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class MicroBatchConfig:
    """How a minibatch is cut into micro-batches (AReaL's ``mb_spec``)."""

    max_tokens_per_mb: int | Literal["auto"] | None = "auto"
    """Token budget of one micro-batch. ``"auto"``: on CUDA the largest budget whose activations fit the device
    memory free at the step, measured in the model's first step (``rlcore.training.memory_budget``), rounded
    down to 1024 tokens; on CPU the same as None. None: unlimited (the whole minibatch in one micro-batch)."""
    n_mbs: int = 1
    """Minimum number of micro-batches."""
    n_mbs_divisor: int = 1
    """The number of micro-batches is rounded up to a multiple of this (e.g. pipeline stages)."""
    granularity: int = 1
    """Keep this many adjacent rows in the same micro-batch (2 for DPO / reward-model pairs)."""
    algorithm: Literal["ffd", "kk"] = "ffd"
    """Allocator: least-loaded first-fit-decreasing, or Karmarkar–Karp with an FFD fallback."""
    attn_weight: float = 0.0
    """Balance ``l + attn_weight·l²`` instead of ``l`` (0 balances tokens only)."""
    memory_fraction: float = 0.9
    """With ``"auto"``: the share of the free device memory (at the step's start) the micro-batches may fill."""
    calibration_tokens: int = 4096
    """With ``"auto"``: tokens (at most, unless one sequence is longer) of each micro-batch the first step
    measures the memory per token on, before it sizes the rest."""

    def __post_init__(self) -> None:
        mt = self.max_tokens_per_mb
        if not (mt is None or mt == "auto" or (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1)):
            raise ValueError(f"max_tokens_per_mb must be an int >= 1, 'auto' or None, got {mt!r}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.calibration_tokens < 1:
            raise ValueError(f"calibration_tokens must be >= 1, got {self.calibration_tokens}")
        if self.n_mbs < 1:
            raise ValueError(f"n_mbs must be >= 1, got {self.n_mbs}")
        if self.n_mbs_divisor < 1:
            raise ValueError(f"n_mbs_divisor must be >= 1, got {self.n_mbs_divisor}")
        if self.granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {self.granularity}")
        if self.attn_weight < 0:
            raise ValueError(f"attn_weight must be >= 0, got {self.attn_weight}")


def _units(lengths: Sequence[int], granularity: int) -> list[list[int]]:
    if len(lengths) % granularity:
        raise ValueError(
            f"{len(lengths)} rows cannot be grouped by granularity={granularity}; pass whole groups (e.g. DPO pairs)"
        )
    return [list(range(i, i + granularity)) for i in range(0, len(lengths), granularity)]


def ffd(sizes: Sequence[int], capacity: float, min_bins: int = 1, costs: Sequence[float] | None = None) -> list[list[int]]:
    """Least-loaded first-fit-decreasing: bins of item indices, each with ``Σ sizes ≤ capacity``.

    ``min_bins`` bins are opened up front (empty ones may remain when there are fewer items).
    Items are visited by decreasing cost (``costs`` defaults to ``sizes``) and balanced on cost.
    """
    costs = list(sizes) if costs is None else list(costs)
    for i, s in enumerate(sizes):
        if s > capacity:
            raise ValueError(
                f"sequence {i} has {s} tokens > max_tokens_per_mb={capacity}; raise max_tokens_per_mb "
                f"to at least the longest sequence"
            )
    bins: list[list[int]] = [[] for _ in range(min_bins)]
    load = [0.0] * min_bins
    cost = [0.0] * min_bins
    for i in sorted(range(len(sizes)), key=lambda j: (-costs[j], -sizes[j], j)):
        fits = [j for j in range(len(bins)) if load[j] + sizes[i] <= capacity]
        if fits:
            j = min(fits, key=lambda j: (cost[j], load[j], j))
        else:
            bins.append([])
            load.append(0.0)
            cost.append(0.0)
            j = len(bins) - 1
        bins[j].append(i)
        load[j] += sizes[i]
        cost[j] += costs[i]
    return bins


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """k-way largest differencing: ``k`` sets of item indices with a small max−min cost spread."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, c in enumerate(costs):
        sets = [(float(c), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), i, sets))
    if not heap:
        return [[] for _ in range(k)]
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        heapq.heappush(heap, (-spread, tie, merged))
        tie += 1
    return [ids for _, ids in heap[0][2]]


def allocate(lengths: Sequence[int], cfg: MicroBatchConfig, *, n_mbs: int | None = None) -> list[list[int]]:
    """Split rows into micro-batches under ``cfg`` (docs/spec/system.md §7.3).

    Args:
      lengths: real token count of each row.
      cfg: the budget (an int or None: ``"auto"`` is resolved by the caller, see the module docstring), minimum
        count, divisor, granularity and algorithm.
      n_mbs: overrides ``cfg.n_mbs`` (used after :func:`sync_num_mbs` so every DP rank runs the same count).

    Returns:
      Lists of row indices, sorted within each list; every row appears exactly once. Lists may be
      empty only when more micro-batches are requested than there are row groups.
    """
    if cfg.max_tokens_per_mb == "auto":
        raise ValueError(
            "allocate needs a number: max_tokens_per_mb='auto' is resolved by the train step "
            "(rlcore.training.memory_budget); pass an int budget or None (unlimited) here"
        )
    units = _units(lengths, cfg.granularity)
    sizes = [sum(lengths[i] for i in u) for u in units]
    costs = [sum(lengths[i] + cfg.attn_weight * lengths[i] ** 2 for i in u) for u in units]
    cap = math.inf if cfg.max_tokens_per_mb is None else cfg.max_tokens_per_mb
    want = cfg.n_mbs if n_mbs is None else n_mbs
    k = max(want, math.ceil(sum(sizes) / cap) if cap < math.inf else 1, 1)
    k = -(-k // cfg.n_mbs_divisor) * cfg.n_mbs_divisor
    bins: list[list[int]] | None = None
    if cfg.algorithm == "kk":
        kk_bins = karmarkar_karp(costs, k)
        if all(sum(sizes[i] for i in b) <= cap for b in kk_bins):
            bins = kk_bins
    if bins is None:
        while True:
            bins = ffd(sizes, cap, min_bins=k, costs=costs)
            if len(bins) % cfg.n_mbs_divisor == 0:
                break
            k = -(-len(bins) // cfg.n_mbs_divisor) * cfg.n_mbs_divisor
    return [sorted(i for u in b for i in units[u]) for b in bins]


def split_across_ranks(lengths: Sequence[int], world_size: int, *, granularity: int = 1) -> list[list[int]]:
    """Balanced greedy DP split with equal row counts per rank (docs/spec/system.md §7.1).

    Row groups (``granularity`` adjacent rows) go largest first to the non-full rank with the smallest
    token sum. The number of groups must divide by ``world_size``.
    """
    units = _units(lengths, granularity)
    if len(units) % world_size:
        raise ValueError(
            f"{len(units)} row groups cannot be split evenly over world_size={world_size}; "
            f"make the batch size a multiple of the data-parallel size"
        )
    per = len(units) // world_size
    sizes = [sum(lengths[i] for i in u) for u in units]
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for u in sorted(range(len(units)), key=lambda j: (-sizes[j], j)):
        r = min((r for r in range(world_size) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(u)
        load[r] += sizes[u]
    return [sorted(i for u in r for i in units[u]) for r in ranks]


def shard_for_rank(
    traj: dict[str, torch.Tensor], rank: int, world_size: int, *, granularity: int = 1
) -> dict[str, torch.Tensor]:
    """This rank's rows of a padded step batch (balanced greedy split of :func:`split_across_ranks`).

    Every rank must pass the same ``traj``; ``granularity`` keeps prompt groups / pairs on one rank.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    lengths = [int(x) for x in traj["attention_mask"].sum(1).tolist()]
    return select_rows(traj, split_across_ranks(lengths, world_size, granularity=granularity)[rank])


def minibatches(lengths: Sequence[int], n_minibatches: int, *, granularity: int = 1) -> list[list[int]]:
    """PPO minibatches (docs/spec/algorithms.md §7.6): the allocator with no token cap and exactly ``n_minibatches`` bins."""
    if n_minibatches < 1:
        raise ValueError(f"n_minibatches must be >= 1, got {n_minibatches}")
    n_units = len(lengths) // max(granularity, 1)
    if n_minibatches > n_units:
        raise ValueError(
            f"ppo_n_minibatches={n_minibatches} exceeds the {n_units} row groups of the local batch; lower it"
        )
    cfg = MicroBatchConfig(max_tokens_per_mb=None, n_mbs=n_minibatches, granularity=granularity, algorithm="ffd")
    return allocate(lengths, cfg)


def calibration_rows(lengths: Sequence[int], tokens: int, *, granularity: int = 1) -> list[int]:
    """The smallest row groups whose total stays within ``tokens``: the rows of a calibration micro-batch.

    Groups (``granularity`` adjacent rows) are taken by increasing token count (ties: lowest index) while the sum
    stays ``<= tokens``; the smallest group is taken even when it alone is longer. Returns sorted row indices
    (empty only for an empty batch).
    """
    units = _units(lengths, granularity)
    sizes = [sum(lengths[i] for i in u) for u in units]
    picked: list[int] = []
    total = 0
    for u in sorted(range(len(units)), key=lambda j: (sizes[j], j)):
        if picked and total + sizes[u] > tokens:
            break
        picked.append(u)
        total += sizes[u]
    return sorted(i for u in picked for i in units[u])


def sync_num_mbs(n: int, group: object | None = None) -> int:
    """All-reduce-max of the local micro-batch count so every DP rank runs the same number.

    Returns ``n`` unchanged without an initialised process group. Ranks that end up with fewer real
    micro-batches run zero-weight ones so FSDP collectives stay in lock-step.
    """
    return sync_max(n, group)


def sync_max(n: int, group: object | None = None) -> int:
    """All-reduce-max of a host integer over the DP ranks (``n`` itself without an initialised process group).

    Every rank of ``group`` must call it the same number of times (it is a collective).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(n)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([int(n)], dtype=torch.long, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def select_rows(traj: dict[str, torch.Tensor], idx: Sequence[int], *, trim: bool = True) -> dict[str, torch.Tensor]:
    """Gather rows ``idx`` of a padded dict; with ``trim`` the width shrinks to the longest selected row."""
    index = torch.as_tensor(list(idx), dtype=torch.long)
    b = traj["input_ids"].shape[0]
    width = traj["input_ids"].shape[1]
    out = {k: v.index_select(0, index.to(v.device)) for k, v in traj.items() if v.dim() >= 1 and v.shape[0] == b}
    if trim and len(idx) and "attention_mask" in out:
        w = max(int(out["attention_mask"].sum(1).max()), 1)
        out = {k: (v[:, :w] if v.dim() >= 2 and v.shape[1] == width and k != "rewards" else v) for k, v in out.items()}
    return out

"""Padded ``(b l)`` trajectory dicts <-> one packed 1-D token stream (docs/spec/system.md §7.2, §7.4).

A packed micro-batch concatenates the real tokens of ``b`` right-padded rows into one stream of
``T = Σ_i l_i`` tokens. ``cu_seqlens`` (int32, ``(b+1,)``) marks the sequence boundaries,
``position_ids`` restart at 0 for every sequence, and ``max_seqlen`` is the longest ``l_i``.
Models run on it with batch dimension 1 and no padding mask: varlen flash-attention reads
``cu_seqlens``; sdpa/eager attention in transformers >= 4.53 derives a block-causal mask from the
restarting ``position_ids`` (``rlcore.training.models`` checks this).

Optional padding (``pad_to_multiple``) appends ONE dummy sequence (ids 0, position ids ``0..pad-1``,
masks False) so the stream length is a multiple of the given size; :func:`unpack` drops it.

Host-side bookkeeping (lengths, offsets) uses Python ints: this is the data path, not leaf math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.data.trajectory import PAD_VALUES


@dataclass(frozen=True)
class PackedBatch:
    """One packed stream plus the information needed to restore the padded layout."""

    tokens: dict[str, torch.Tensor]
    """Per-token keys as 1-D ``(T,)`` streams (``T`` includes the dummy pad sequence, if any)."""
    rows: dict[str, torch.Tensor]
    """Per-row keys (e.g. ``rewards`` ``(b,)``) passed through unchanged."""
    cu_seqlens: torch.Tensor
    """int32 ``(n+1,)`` cumulative lengths; ``n = b`` (+1 when padded)."""
    position_ids: torch.Tensor
    """int64 ``(T,)`` positions, restarting at 0 for every sequence."""
    max_seqlen: int
    """Longest sequence in the stream (the dummy pad sequence included)."""
    lengths: tuple[int, ...]
    """Real length of each of the ``b`` rows."""
    width: int
    """Padded width ``l`` of the source dict, used by :func:`unpack`."""
    pad: int = 0
    """Number of dummy tokens appended at the end of the stream."""

    @property
    def num_seqs(self) -> int:
        """Number of real sequences ``b`` (the dummy pad sequence excluded)."""
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """Real tokens ``Σ l_i`` (padding excluded)."""
        return int(sum(self.lengths))


def seq_lengths(traj: dict[str, torch.Tensor]) -> list[int]:
    """Real length of each row of a right-padded dict, from ``attention_mask`` ``(b l)``."""
    if "attention_mask" not in traj:
        raise KeyError("trajectory dict needs an 'attention_mask' (b, l) entry; build rows with trajectory.make_row")
    am = traj["attention_mask"].bool()
    lengths = am.sum(1)
    width = am.shape[1]
    prefix = torch.arange(width)[None, :] < lengths[:, None]
    if not torch.equal(prefix, am):
        raise ValueError("attention_mask must be a right-padded prefix mask (True then False on every row)")
    return [int(x) for x in lengths.tolist()]


def _is_token_key(k: str, v: torch.Tensor, b: int, width: int) -> bool:
    return v.dim() >= 2 and v.shape[0] == b and v.shape[1] == width and k != "rewards"


def _stream_index(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``(row, column)`` of every real token of a right-padded batch, ``(Σ l_i,)`` each (no per-row loop)."""
    len_t = torch.tensor(lengths, dtype=torch.long)
    total = int(sum(lengths))
    row_idx = torch.repeat_interleave(torch.arange(len(lengths)), len_t, output_size=total)
    starts = torch.cumsum(len_t, 0) - len_t
    col_idx = torch.arange(total) - torch.repeat_interleave(starts, len_t, output_size=total)
    return row_idx, col_idx


def pack(
    traj: dict[str, torch.Tensor], *, pad_to_multiple: int | None = None, lengths: list[int] | None = None
) -> PackedBatch:
    """Pack a right-padded trajectory dict into one stream.

    Args:
      traj: per-token tensors ``(b l, ...)`` and per-row tensors ``(b, ...)``; must hold ``attention_mask``.
      pad_to_multiple: if set, append one dummy sequence so that ``T`` is a multiple of it.
      lengths: the rows' real lengths when the caller already has them on the host (the train step does): skips
        reading and validating ``attention_mask`` again, so packing reads no tensor value (no device sync when
        ``traj`` lives on a GPU). They must equal ``attention_mask.sum(1)``.

    Returns:
      A :class:`PackedBatch`; per-token keys become ``(T, ...)``. The number of tensor ops does not depend on
      the number of rows.
    """
    if pad_to_multiple is not None and pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1 or None, got {pad_to_multiple}")
    b, width = traj["attention_mask"].shape
    if lengths is None:
        lengths = seq_lengths(traj)
    elif len(lengths) != b:
        raise ValueError(f"pack: got {len(lengths)} lengths for {b} rows")
    lengths = [int(x) for x in lengths]
    total = sum(lengths)
    pad = 0 if pad_to_multiple is None else (-total) % pad_to_multiple
    row_idx, col_idx = _stream_index(lengths)
    tokens: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    idx_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, v in traj.items():
        if _is_token_key(k, v, b, width):
            if v.device not in idx_on:
                idx_on[v.device] = (row_idx.to(v.device, non_blocking=True), col_idx.to(v.device, non_blocking=True))
            r, c = idx_on[v.device]
            flat = v[r, c]
            if pad:
                fill = torch.full((pad, *v.shape[2:]), PAD_VALUES.get(k, 0), dtype=v.dtype, device=v.device)
                flat = torch.cat([flat, fill], 0)
            tokens[k] = flat
        else:
            rows[k] = v
    seqs = [*lengths, pad] if pad else list(lengths)
    cu = torch.tensor([0, *seqs], dtype=torch.long).cumsum(0)
    n_all = total + pad
    # positions restart per sequence: t - start(sequence of t), one vectorised op for any number of sequences
    pos = torch.arange(n_all) - torch.repeat_interleave(cu[:-1], torch.tensor(seqs, dtype=torch.long), output_size=n_all)
    return PackedBatch(
        tokens=tokens,
        rows=rows,
        cu_seqlens=cu.to(torch.int32),
        position_ids=pos.long(),
        max_seqlen=max(seqs) if seqs else 0,
        lengths=tuple(lengths),
        width=int(width),
        pad=pad,
    )


def unpack_tensor(x: torch.Tensor, packed: PackedBatch, *, fill: float | int | bool = 0) -> torch.Tensor:
    """Scatter a stream ``(T, ...)`` (dummy padding included or not) back to ``(b l, ...)``.

    Positions beyond each row's length get ``fill``. The scatter index is built on the host and copied without
    blocking, so unpacking a GPU stream issues no device sync.
    """
    lengths = packed.lengths
    total = sum(lengths)
    if x.shape[0] not in (total, total + packed.pad):
        raise ValueError(f"stream length {x.shape[0]} matches neither {total} real tokens nor {total + packed.pad}")
    b = len(lengths)
    out = torch.full((b, packed.width, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    row_idx, col_idx = _stream_index(list(lengths))
    nb = x.device.type == "cuda"
    out[row_idx.to(x.device, non_blocking=nb), col_idx.to(x.device, non_blocking=nb)] = x[:total]
    return out


def unpack(packed: PackedBatch) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack`: exact round trip (padding takes ``trajectory.PAD_VALUES``)."""
    out = {k: unpack_tensor(v, packed, fill=PAD_VALUES.get(k, 0)) for k, v in packed.tokens.items()}
    out.update(packed.rows)
    return out


def roll_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, *, fill: float | int | bool = 0) -> torch.Tensor:
    """Shift a stream left by one WITHIN each sequence: ``y[t] = x[t+1]``, last token of a sequence -> ``fill``.

    This is the predictive alignment of docs/spec/algorithms.md §0.2 applied to a packed stream (the wrapped
    position is masked anyway, so ``fill`` replaces the wrap-around).
    """
    y = torch.roll(x, -1, dims=0)
    last = cu_seqlens[1:].long() - 1
    last = last[(cu_seqlens[1:] - cu_seqlens[:-1]) > 0]
    y[last] = torch.as_tensor(fill, dtype=x.dtype, device=x.device)
    return y

"""The trajectory dict: what workflows return and what the trainer consumes.

A trajectory is a plain ``dict[str, Tensor]`` with a leading row dimension (docs/spec/system.md §1.3):

| key            | dtype   | shape   | content                                                     |
|----------------|---------|---------|-------------------------------------------------------------|
| input_ids      | int64   | (b, l)  | prompt ++ generated (++ feedback/tool) tokens               |
| attention_mask | bool    | (b, l)  | True on real tokens, False on right padding                 |
| loss_mask      | bool    | (b, l)  | True exactly on tokens the policy sampled                   |
| logprobs       | float32 | (b, l)  | behaviour log-prob at the sampled token's own position      |
| versions       | int64   | (b, l)  | weight version that produced each sampled token, -1 else    |
| turn_ids       | int64   | (b, l)  | assistant-turn index on sampled tokens, -1 else             |
| rewards        | float32 | (b,)    | one scalar reward per row                                   |
| group_ids      | int64   | (b,)    | the prompt group of every row (``concat_groups``; optional) |

Token-own alignment is kept here; the single shift to predictive alignment happens in
``rlcore.training.step`` (docs/spec/algorithms.md §0.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "turn_ids")
PAD_VALUES = {"input_ids": 0, "attention_mask": False, "loss_mask": False, "logprobs": 0.0, "versions": -1, "turn_ids": -1}


def make_row(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    output_versions: Sequence[int],
    reward: float,
    turn: int = 0,
    truncated: bool | None = None,
) -> dict[str, torch.Tensor]:
    """One single-turn row ``(1, len(prompt)+len(output))``: prompt masked, output trainable.

    ``truncated`` (the engine stopped at its length limit, no EOS) adds the ``(1,)`` bool ``truncated`` key that
    GAE bootstraps and ``GAEConfig.mask_no_eos_with_zero`` zeroes; None leaves the key out.

    Each tensor is built from a NumPy array (``torch.from_numpy``): converting a Python list there is about three
    times cheaper than ``torch.tensor(list)``, and rollouts build one row per sample."""
    if not (len(output_ids) == len(output_logprobs) == len(output_versions)):
        raise ValueError(
            f"output_ids/output_logprobs/output_versions must have equal lengths, got "
            f"{len(output_ids)}/{len(output_logprobs)}/{len(output_versions)}"
        )
    p, o = len(prompt_ids), len(output_ids)
    gen = np.zeros((1, p + o), dtype=np.bool_)
    gen[0, p:] = True
    turns = np.full((1, p + o), -1, dtype=np.int64)
    turns[0, p:] = int(turn)
    row = {
        "input_ids": torch.from_numpy(np.array([[*prompt_ids, *output_ids]], dtype=np.int64)),
        "attention_mask": torch.ones((1, p + o), dtype=torch.bool),
        "loss_mask": torch.from_numpy(gen),
        "logprobs": torch.from_numpy(np.array([[0.0] * p + [float(x) for x in output_logprobs]], dtype=np.float32)),
        "versions": torch.from_numpy(np.array([[-1] * p + [int(v) for v in output_versions]], dtype=np.int64)),
        "turn_ids": torch.from_numpy(turns),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
    }
    if truncated is not None:
        row["truncated"] = torch.tensor([bool(truncated)])
    return row


def make_group(
    prompt_ids: Sequence[int],
    outputs: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]],
    rewards: Sequence[float],
    turn: int = 0,
    truncated: Sequence[bool] | None = None,
) -> dict[str, torch.Tensor]:
    """``concat([make_row(prompt_ids, *outputs[i], rewards[i], turn, truncated[i]) for i ...])`` in one pass: ``g``
    samples of one prompt as ``(g, len(prompt) + longest output)`` rows, right-padded with ``PAD_VALUES``.

    ``outputs[i]`` is ``(output_ids, output_logprobs, output_versions)``. Each key is filled in one NumPy array and
    wrapped once (``torch.from_numpy``), instead of seven tensors per row and a concatenation per key: a group
    episode's rows cost a few tensor operations, not a few dozen per sample."""
    g = len(outputs)
    if g == 0:
        raise ValueError("make_group needs at least one output")
    if len(rewards) != g or (truncated is not None and len(truncated) != g):
        raise ValueError(f"make_group: {g} outputs but {len(rewards)} rewards"
                         + ("" if truncated is None else f" and {len(truncated)} truncated flags"))
    for i, (ids, lp, ver) in enumerate(outputs):
        if not (len(ids) == len(lp) == len(ver)):
            raise ValueError(
                f"output_ids/output_logprobs/output_versions must have equal lengths, got "
                f"{len(ids)}/{len(lp)}/{len(ver)} (sample {i})"
            )
    p = len(prompt_ids)
    lens = [len(o[0]) for o in outputs]
    width = p + max(lens)
    ids = np.zeros((g, width), dtype=np.int64)
    ids[:, :p] = np.asarray(prompt_ids, dtype=np.int64)
    logp = np.zeros((g, width), dtype=np.float32)
    ver = np.full((g, width), -1, dtype=np.int64)
    for i, (o_ids, o_lp, o_ver) in enumerate(outputs):
        if lens[i]:
            ids[i, p : p + lens[i]] = o_ids
            logp[i, p : p + lens[i]] = [float(x) for x in o_lp]  # float() refuses None, as make_row does
            ver[i, p : p + lens[i]] = [int(v) for v in o_ver]
    pos = np.arange(width)[None, :]
    end = p + np.asarray(lens)[:, None]
    real = pos < end
    gen = real & (pos >= p)
    group = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(real),
        "loss_mask": torch.from_numpy(gen),
        "logprobs": torch.from_numpy(logp),
        "versions": torch.from_numpy(ver),
        "turn_ids": torch.from_numpy(np.where(gen, int(turn), -1).astype(np.int64)),
        "rewards": torch.from_numpy(np.asarray([float(r) for r in rewards], dtype=np.float32)),
    }
    if truncated is not None:
        group["truncated"] = torch.from_numpy(np.asarray([bool(t) for t in truncated], dtype=np.bool_))
    return group


def _is_token_key(k: str, v: torch.Tensor, width: int) -> bool:
    return v.dim() >= 2 and v.shape[1] == width and k != "rewards"


def concat(trajs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every per-token tensor to the longest row and concatenate along rows.

    Per-row keys (1-D tensors such as ``rewards``) are concatenated as they are; other keys must
    be tensors with a leading row dimension too.

    Fast path (a group of single rows, e.g. ``make_row`` outputs, all with the same keys): each per-token key is one
    ``torch.cat`` of the rows side by side, scattered into a pre-filled ``(b, width)`` tensor through a mask of the
    real positions: three tensor operations per key instead of two per row and key. Same result as the general path.
    """
    if not trajs:
        raise ValueError("concat needs at least one trajectory")
    widths = [int(t["input_ids"].shape[1]) for t in trajs]
    width = max(widths)
    if len(trajs) > 1 and min(widths) < width:
        fast = _concat_single_rows(trajs, widths, width)
        if fast is not None:
            return fast
    out: dict[str, list[torch.Tensor]] = {}
    for t in trajs:
        for k, v in t.items():
            if _is_token_key(k, v, t["input_ids"].shape[1]):
                pad = width - v.shape[1]
                if pad:
                    fill = PAD_VALUES.get(k, 0)
                    v = torch.cat([v, torch.full((v.shape[0], pad, *v.shape[2:]), fill, dtype=v.dtype)], dim=1)
            out.setdefault(k, []).append(v)
    return {k: torch.cat(vs, dim=0) for k, vs in out.items()}


def concat_groups(groups: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``concat`` of whole groups (one prompt's samples each), plus ``group_ids (b,)`` int64: the index of each row's
    group in ``groups``. Group statistics (GRPO, RLOO, ...) are taken over these real groups, so a group that lost a
    sample (a failed reward, a dropped row) is exactly a smaller group and never borrows its neighbour's rows."""
    out = concat(groups)
    sizes = torch.tensor([num_rows(g) for g in groups], dtype=torch.long)
    out["group_ids"] = torch.repeat_interleave(torch.arange(len(groups), dtype=torch.long), sizes)
    return out


def _concat_single_rows(
    trajs: Sequence[dict[str, torch.Tensor]], widths: list[int], width: int
) -> dict[str, torch.Tensor] | None:
    """``concat`` of trajectories that are one row each with the same keys (None when they are not): the per-token
    keys of shape ``(1, l_i)`` become ``(b, width)``, the others are concatenated along rows. Each key must have one
    dtype in every trajectory (the padding is then that dtype's fill, as on the general path)."""
    keys = list(trajs[0])
    kinds: list[tuple[bool, torch.dtype]] = []
    for t, w in zip(trajs, widths):
        if list(t) != keys:
            return None
        kind = []
        for k, v in t.items():
            s = v.shape
            tok = len(s) >= 2 and s[1] == w and k != "rewards"
            if tok and (len(s) != 2 or s[0] != 1):
                return None
            kind.append((tok, v.dtype))
        if not kinds:
            kinds = kind
        elif kind != kinds:
            return None
    mask = torch.from_numpy(np.arange(width)[None, :] < np.array(widths)[:, None])  # (b, width): real positions
    out: dict[str, torch.Tensor] = {}
    for k, (tok, dtype) in zip(keys, kinds):
        vs = [t[k] for t in trajs]
        if not tok:
            out[k] = torch.cat(vs, dim=0)
            continue
        flat = torch.cat(vs, dim=1)  # (1, sum l_i): the rows one after the other
        out[k] = torch.full((len(trajs), width), PAD_VALUES.get(k, 0), dtype=dtype).masked_scatter_(mask, flat)
    return out


def num_rows(traj: dict[str, torch.Tensor]) -> int:
    """Number of rows (sequences) in a trajectory dict."""
    return int(traj["input_ids"].shape[0])

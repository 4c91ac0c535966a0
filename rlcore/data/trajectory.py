"""The trajectory dict: what workflows return and what the trainer consumes.

A trajectory is a plain ``dict[str, Tensor]`` with a leading row dimension (spec system.md §1.3):

| key            | dtype   | shape   | content                                                     |
|----------------|---------|---------|-------------------------------------------------------------|
| input_ids      | int64   | (b, l)  | prompt ++ generated (++ feedback/tool) tokens               |
| attention_mask | bool    | (b, l)  | True on real tokens, False on right padding                 |
| loss_mask      | bool    | (b, l)  | True exactly on tokens the policy sampled                   |
| logprobs       | float32 | (b, l)  | behaviour log-prob at the sampled token's own position      |
| versions       | int64   | (b, l)  | weight version that produced each sampled token, -1 else    |
| turn_ids       | int64   | (b, l)  | assistant-turn index on sampled tokens, -1 else             |
| rewards        | float32 | (b,)    | one scalar reward per row                                   |

Token-own alignment is kept here; the single shift to predictive alignment happens in
``rlcore.training.step`` (spec algorithms.md §0.2).
"""

from __future__ import annotations

from collections.abc import Sequence

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
) -> dict[str, torch.Tensor]:
    """One single-turn row ``(1, len(prompt)+len(output))``: prompt masked, output trainable."""
    if not (len(output_ids) == len(output_logprobs) == len(output_versions)):
        raise ValueError(
            f"output_ids/output_logprobs/output_versions must have equal lengths, got "
            f"{len(output_ids)}/{len(output_logprobs)}/{len(output_versions)}"
        )
    p, o = len(prompt_ids), len(output_ids)
    ids = torch.tensor([*prompt_ids, *output_ids], dtype=torch.long)[None]
    gen = torch.tensor([False] * p + [True] * o)[None]
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": gen,
        "logprobs": torch.tensor([0.0] * p + [float(x) for x in output_logprobs], dtype=torch.float32)[None],
        "versions": torch.tensor([-1] * p + [int(v) for v in output_versions], dtype=torch.long)[None],
        "turn_ids": torch.where(gen, torch.tensor(turn), torch.tensor(-1)),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
    }


def concat(trajs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every per-token tensor to the longest row and concatenate along rows.

    Per-row keys (1-D tensors such as ``rewards``) are concatenated as they are; other keys must
    be tensors with a leading row dimension too.
    """
    if not trajs:
        raise ValueError("concat needs at least one trajectory")
    width = max(int(t["input_ids"].shape[1]) for t in trajs)
    out: dict[str, list[torch.Tensor]] = {}
    for t in trajs:
        for k, v in t.items():
            if v.dim() >= 2 and v.shape[1] == t["input_ids"].shape[1] and k != "rewards":
                pad = width - v.shape[1]
                if pad:
                    fill = PAD_VALUES.get(k, 0)
                    v = torch.cat([v, torch.full((v.shape[0], pad, *v.shape[2:]), fill, dtype=v.dtype)], dim=1)
            out.setdefault(k, []).append(v)
    return {k: torch.cat(vs, dim=0) for k, vs in out.items()}


def num_rows(traj: dict[str, torch.Tensor]) -> int:
    """Number of rows (sequences) in a trajectory dict."""
    return int(traj["input_ids"].shape[0])

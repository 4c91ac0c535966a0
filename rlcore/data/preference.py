"""Preference pairs built from GSM8K worked solutions (for DPO / IPO and Bradley–Terry reward models).

The chosen response is the cleaned worked solution with its ``\\boxed{}`` final answer; the rejected
one is the same text with a wrong final answer, so the pair differs only where correctness does.
A pair is a ``(2 l)`` trajectory dict ``[chosen, rejected]`` (see ``rlcore.data.trajectory``) whose
``loss_mask`` marks the response tokens (target ++ eos); micro-batching keeps the two rows together.
"""

from __future__ import annotations

import random
import re

import torch

from rlcore.data import trajectory


def solution_pair(solution: str, rng: random.Random) -> tuple[str, str]:
    """(chosen, rejected) target texts for one GSM8K ``answer`` field (worked solution ending in ``#### n``)."""
    if "####" not in solution:
        raise ValueError(f"solution must end with '#### <final answer>', got {solution[-60:]!r}")
    body, final = solution.rsplit("####", 1)
    body = re.sub(r"<<[^>]*>>", "", body).strip()  # calculator annotations are not part of the text
    final = final.strip().replace(",", "")
    try:
        wrong = str(int(float(final)) + rng.choice([-10, -2, -1, 1, 2, 10]))
    except ValueError:
        wrong = final + "1"
    return (f"{body}\nThe answer is \\boxed{{{final}}}.", f"{body}\nThe answer is \\boxed{{{wrong}}}.")


def make_pair(tok, prompt_ids: list[int], solution: str, rng: random.Random) -> dict[str, torch.Tensor]:
    """``(2 l)`` rows [chosen, rejected] = prompt ++ target ++ eos, ``loss_mask`` True on target ++ eos."""
    rows = []
    for text in solution_pair(solution, rng):
        target = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([list(prompt_ids) + target])
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                "loss_mask": torch.tensor([[False] * len(prompt_ids) + [True] * len(target)]),
            }
        )
    return trajectory.concat(rows)

"""Seeded random generators for any seed a user gives.

`--seed` and the recipes' `seed` keys take any integer, and call sites derive further seeds from
them (seed * 1_000_003 + sample index), while torch's generators take only 64-bit values and fail
with an internal "Overflow" beyond. Every generator is made here, from the value reduced into
[0, 2^63): the seeds users give in practice (small, non-negative) are used unchanged.
"""

from __future__ import annotations

import torch

SEED_RANGE = 2**63


def seeded_generator(value: int) -> torch.Generator:
    """A CPU generator seeded with `value`, whatever its size or sign."""
    return torch.Generator().manual_seed(int(value) % SEED_RANGE)


def seed_everything(seed: int) -> None:
    """The global generators (torch's, and every GPU's), for steps that draw from them."""
    torch.manual_seed(int(seed) % SEED_RANGE)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(int(seed) % SEED_RANGE)

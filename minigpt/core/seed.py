"""One seed range for every command: train, sample, attention and the data order all take a seed in [0, MAX_SEED]."""

from __future__ import annotations

from minigpt.core.errors import UserError

MAX_SEED = 2**32 - 1  # Lightning's seed_everything (numpy's legacy seeding) takes no more; torch takes more


def check_seed(seed: int, flag: str = "--seed") -> int:
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"{flag} must be in [0, {MAX_SEED}], got {seed}; use e.g. 1337")
    return seed

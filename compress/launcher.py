"""Which of the processes a launcher started this one is, read from the launcher's environment
variables. Plain Python: compress/__main__.py asks before torch has loaded."""

from __future__ import annotations

import os

# Where a launcher says which process this is: torchrun (and `accelerate launch` on GPUs) set
# RANK and WORLD_SIZE; MPI launchers (`accelerate launch --cpu` over mpirun) their own, which
# accelerate reads only once an Accelerator exists: too late for who writes the output.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
_WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def process_rank() -> int:
    """This process's rank among those a launcher started (0 when run alone)."""
    return _first_int(_RANK_VARIABLES, 0)


def process_count() -> int:
    """How many processes a launcher started (1 when run alone)."""
    return max(1, _first_int(_WORLD_VARIABLES, 1))

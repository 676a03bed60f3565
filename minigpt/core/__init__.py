"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

import time

from minigpt.core import bytecode_cache  # imports nothing heavy: the clock starts before torch loads

__version__ = "0.1.0"  # pyproject.toml's (a test keeps them equal); here, so `minigpt --version` reads it below cli
IMPORTED_AT = time.perf_counter()  # the first minigpt import: where /proc is missing, start-up is timed from here
bytecode_cache.keep_bytecode()  # before torch: where the environment keeps no compiled modules, a cache of our own
# torch itself loads with the first module that needs it (core.model keys compiled graphs by the CPU kind), not
# here: the commands' entry (minigpt.cli.main) imports core.errors first, and is then ready for a Ctrl-C

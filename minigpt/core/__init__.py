"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

import time

from minigpt.core import inductor_cache  # imports nothing heavy itself: the clock below starts before torch loads

IMPORTED_AT = time.perf_counter()  # the first minigpt import: where /proc is missing, start-up is timed from here
inductor_cache.key_compiled_graphs_by_cpu_kind()  # before anything compiles: graphs cached per CPU kind

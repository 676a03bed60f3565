"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

import time

from minigpt.core import bytecode_cache, inductor_cache  # import nothing heavy: the clock starts before torch loads

IMPORTED_AT = time.perf_counter()  # the first minigpt import: where /proc is missing, start-up is timed from here
bytecode_cache.keep_bytecode()  # before torch: where the environment keeps no compiled modules, a cache of our own
inductor_cache.key_compiled_graphs_by_cpu_kind()  # before anything compiles: graphs cached per CPU kind

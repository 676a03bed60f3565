"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

import time

from minigpt.core.inductor_cache import separate_cache_per_cpu_kind

IMPORTED_AT = time.perf_counter()  # the first minigpt import: where /proc is missing, start-up is timed from here
separate_cache_per_cpu_kind()  # before anything compiles: an emulated CPU kind's compiled graphs kept apart

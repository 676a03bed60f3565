"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

import time

IMPORTED_AT = time.perf_counter()  # the first minigpt import: where /proc is missing, start-up is timed from here

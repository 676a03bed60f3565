"""The core: config, model, generation, tokenizers and the checkpoint format.

Imports no Lightning and no matplotlib: sampling, evaluation and export start fast from here.
"""

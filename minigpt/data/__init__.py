"""Corpora into token files: sources (files, folders, URLs, `datasets` tables) and their preparation."""

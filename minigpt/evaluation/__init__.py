"""Evaluation: loss and bits per character/byte on a text (loss), and EleutherAI's lm-evaluation-harness run
in process on a minigpt model (harness)."""

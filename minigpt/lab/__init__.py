"""The attention lab: capture every head's weights, per-head metrics, the offline page and the figures."""

"""An averager's state: ``AverageState`` (its tensors and counters, and the one interface the I/O packages
use), writing an average into the model (``swap``), and the typed ``Description`` of a saved state,
which the on-disk format parses into and writes from.

It may import: base, rules, layouts, strategies, update.
"""

"""The on-disk format and the averager's checkpoints: the format (names, manifest, chunk tables,
parsing a description whole), streaming safetensors and atomic files (``storage``), what shardavg
may replace and its lock (``ownership``), reading a committed checkpoint as one save (``reading``),
``save``/``load`` and DCP's Stateful protocol.

It may import: base, rules, layouts, strategies, update, state.
"""

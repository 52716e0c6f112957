"""The on-disk format of the averager's checkpoints, which knows a saved averager only by its
description: the typed ``Description`` (``description``) and the format that checks and parses it
(names, manifest, chunk tables: ``format``), streaming safetensors and atomic files (``storage``),
what shardavg may replace and its lock (``ownership``), reading a committed checkpoint as one save
(``reading``), and a save's folder prepared, committed and pruned (``saving``). The live state's
``save``/``load`` and DCP's Stateful protocol stand above, in ``averager/``.

It may import: base, rules, layouts, strategies, update.
"""

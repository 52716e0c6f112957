"""The base: errors, argument checks, logging, progress, the process group's few helpers
(``agree_or_raise`` around collective I/O), the one link confinement check for files other tools
wrote (``links.confined``), JSON and pickles from other tools parsed with their nesting bounded
(``untrusted``), and the dtypes shardavg stores and how they are spelled.
Everything else stands on it; it imports nothing of shardavg.

It may import: nothing.
"""

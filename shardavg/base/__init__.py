"""The base: errors, argument checks, logging, progress, the process group's few helpers
(``agree_or_raise`` around collective I/O), and the dtypes shardavg stores and how they are spelled.
Everything else stands on it; it imports nothing of shardavg.

It may import: nothing.
"""

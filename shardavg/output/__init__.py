"""Model folders: the consolidated export (gathered, or written by every rank where its parts lie), the
weight files' plan and writers, the folder's carried files and declared dtype (``model_folder``),
and the record of how a folder was made (``provenance``).

It may import: base, state, checkpoints.
"""

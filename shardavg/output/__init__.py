"""Model folders, everything that writes or reads one: the record of how a folder was made
(``record``, with its provenance: ``provenance``), OUT's one check (``target``), the weight
files' plan and writers (``weight_files``), the folder's weights, carried files and declared
dtype (``model_folder``), the work split between writers (``work``), the driver every writer
goes through with the cast and its overflow refusal (``model_writer``, which the averager's
consolidated export in ``averager/export.py`` also drives); and a merge written as a DCP
checkpoint by every writer (``dcp_checkpoint``), for Megatron-Core inputs in a Megatron-LM run
folder (``megatron_run``); and the write options, declared once (``write_options``).

It may import: base, checkpoints.
"""

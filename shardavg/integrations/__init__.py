"""Integrations with the frameworks' own loops and checkpointing: ``accelerate`` (``save_state``/
``load_state`` hooks), ``deepspeed`` (an engine's ``save_checkpoint``/``load_checkpoint`` with the
average inside the tag), ``transformers`` (a Trainer callback) and ``lightning`` (a callback for
sharded strategies). Each imports its framework only when used; the rest of shardavg never does.
The face is the averager (``shardavg.WeightAverager``).

It may import: base, rules, checkpoints, output, face.
"""

"""Integrations with the engines' and frameworks' own checkpointing: ``deepspeed`` (an engine's
``save_checkpoint``/``load_checkpoint`` with the average inside the tag) and ``accelerate``
(``save_state``/``load_state`` hooks). Each imports its framework only when used."""

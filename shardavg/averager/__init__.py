"""The averager, and everything that takes its live state (an ``AverageState``): the face users hold
(``WeightAverager``, in ``weight_averager``), the state itself (``average_state``: its tensors and
counters, and the one interface the rest of this package reads), writing an average into the model
(``swap``), ``save``/``load``/``check`` of its checkpoints (``checkpoint``), DCP's Stateful protocol
(``stateful``), and its consolidated export with ``full_state_dict`` and ``copy_to`` (``export``).

The packages below it know the averager only by its ``Description``: the on-disk format
(``checkpoints``) and model folders (``output``) read and write descriptions and tensors, never the
live state, so that a file can be read, checked or merged without one.

It may import: base, rules, layouts, strategies, update, checkpoints, output.
"""

from .weight_averager import WeightAverager, checked_options, update_bn

__all__ = ["WeightAverager", "checked_options", "update_bn"]

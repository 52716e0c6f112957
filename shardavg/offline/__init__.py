"""Work on saved checkpoints in one process, without a process group: reading an averager's save or DCP
entry tensor by tensor (``saved_average``), the kinds of checkpoint a merge reads (``sources``), and
the merge itself: its methods, each input's share (``methods``), the tensors and the names it writes
(``merge_names``), and its plan and writers (``merge``).

It may import: base, rules, layouts, update, checkpoints, output.
"""

"""The update pipeline: the averager's ``Options`` and each tensor's role, the ``Updater`` that groups
the live views and shadows, the fused passes (``fused``; the Triton kernel in ``kernels`` and
``masked_lerp`` on CUDA), staging of offloaded or cast weights, the background thread, the watch
on the model's structure, and the non-finite check's trust (``check``: when the loop's verdict
stands in for the screen).

It may import: base, rules, layouts, strategies.
"""

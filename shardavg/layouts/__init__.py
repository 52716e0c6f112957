"""Where a tensor's elements lie: a ``Part`` (the boxes of the global tensor a rank's local shard
holds), a ``TensorLayout`` (every rank's part, derived from the rule the engine shards by), the
``TensorInfo`` a strategy returns for each tensor, and the ``ShardLayout`` of a whole model that
gathers full tensors from the ranks' parts.

It may import: base.
"""

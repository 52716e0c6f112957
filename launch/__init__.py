"""The main job and its modules: ``torchrun --nproc_per_node 2 -m launch.train --config configs/fsdp2.yaml``."""

"""Continuous batching inside one tensor-parallel group: requests join and leave a running batch at
every step (iteration-level scheduling), prompts are prefilled in chunks between decode steps, and
rank 0 leads while the other ranks follow its plan through the group's own collectives."""

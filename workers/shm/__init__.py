"""Shared-memory collectives for CPU ranks on one node (gloo stays for ranks on other nodes).

- native.py: the C helpers (atomic publish, spin-yield-sleep wait with timeout), built once into
  a per-user 0700 directory and loaded only after ownership and mode checks.
- exchange.py: one node's segment and its reduce / broadcast / gather steps.
- collectives.py: ShmCollectives (one node) and HierarchicalCollectives (several nodes).
- group.py: build_cpu_collectives, which CpuBackend.init_process_group calls after gloo is up.
"""

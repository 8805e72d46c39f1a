"""Ray plumbing: connecting to a cluster, sizing and placing rank bundles, the rank actors, one TP
group's life (tp_group), and the replicas that serve and restart groups (replica_pool)."""

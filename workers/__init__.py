"""One rank's life: backend, process group, its shard, its model, KV cache and sampling."""

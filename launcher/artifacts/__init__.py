"""Directories the launcher writes and starts from: compiled-model directories (compiled_dir) and
the pre-sharded copy it keeps of a layout (presharded_cache)."""

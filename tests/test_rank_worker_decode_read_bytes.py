"""decode_read_bytes (the benchmarks' memory-bandwidth bound) leaves out the untied input embedding
under each family's own name: DBRX calls it transformer.wte.weight, Llama model.embed_tokens.weight."""

from __future__ import annotations

import pytest

from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model

VOCAB, HIDDEN = 128, 64


@pytest.mark.parametrize("model_type", ["llama", "dbrx"])
def test_an_untied_input_embedding_is_left_out_of_the_decode_read_bytes(tmp_path, model_type):
    from workers.rank_worker import LoadSpec, RankWorker, WorkerSpec

    path = save_model(build_random_model(model_type, vocab_size=VOCAB, hidden_size=HIDDEN), tmp_path / "m")
    config = load_model_config(path)
    assert not config.tie_word_embeddings  # the case where the lookup reads one row a token
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))
    worker.init_backend("127.0.0.1", 0, 10.0)
    try:
        stats = worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                                     model_dir=str(path)))
    finally:
        worker.shutdown()
    embedding = VOCAB * HIDDEN * 4
    assert stats.decode_read_bytes == stats.shard_bytes - embedding
    assert stats.shard_bytes > 2 * embedding  # the table and the untied head were both read

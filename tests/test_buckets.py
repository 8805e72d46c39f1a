"""shardlib.buckets: automatic buckets, custom lists, selection, and the past-the-largest errors."""

from __future__ import annotations

import pytest

from shardlib.buckets import (Buckets, RequestShape, auto_buckets, normalize_buckets, parse_buckets,
                              request_shape, select_bucket)


@pytest.mark.parametrize("maximum, expected", [
    (4096, (128, 256, 512, 1024, 2048, 4096)),
    (300, (128, 256, 300)),      # the maximum itself is the last bucket
    (256, (128, 256)),           # ... and is not repeated when it is a power of two
    (128, (128,)),
    (129, (128, 129)),
    (100, (100,)),               # below the smallest automatic bucket: the maximum alone
])
def test_auto_buckets_are_powers_of_two_from_128_then_the_maximum(maximum, expected):
    assert auto_buckets(maximum) == expected


def test_auto_batch_buckets_start_at_one():
    assert auto_buckets(8, minimum=1) == (1, 2, 4, 8)
    assert auto_buckets(6, minimum=1) == (1, 2, 4, 6)
    assert auto_buckets(1, minimum=1) == (1,)


def test_smallest_bucket_that_fits_is_selected():
    buckets = (128, 256, 300)
    assert [select_bucket(n, buckets) for n in (1, 128, 129, 256, 257, 300)] == [128, 128, 256, 256, 300, 300]


def test_past_the_largest_bucket_names_both_lengths():
    with pytest.raises(ValueError, match=r"prompt length \(301\) is longer than the largest context-encoding "
                                         r"bucket \(300\)"):
        Buckets.build(max_seq_len=300).context_bucket(301)
    with pytest.raises(ValueError, match=r"sequence length \(513\) is longer than the largest token-generation "
                                         r"bucket \(512\)"):
        Buckets.build(max_seq_len=512).token_bucket(513)
    with pytest.raises(ValueError, match=r"batch size \(5\) is longer than the largest batch bucket \(4\)"):
        Buckets.build(max_seq_len=512, max_batch_size=4).batch_bucket(5)


def test_context_buckets_go_to_max_context_length_and_token_buckets_to_max_seq_len():
    b = Buckets.build(max_context_length=512, max_seq_len=2048, max_batch_size=4)
    assert b.context == (128, 256, 512) and b.token == (128, 256, 512, 1024, 2048) and b.batch == (1, 2, 4)
    assert (b.max_context_length, b.max_seq_len, b.max_batch_size) == (512, 2048, 4)
    # default max_context_length: the sequence length; a larger one is capped by it
    assert Buckets.build(max_seq_len=300).context == (128, 256, 300)
    assert Buckets.build(max_context_length=4096, max_seq_len=256).context == (128, 256)


def test_custom_lists_override_and_are_sorted_and_deduplicated():
    b = Buckets.build(max_seq_len=4096, context=[64, 32, 64], token=[1000, 100], batch=[3, 1])
    assert b.context == (32, 64) and b.token == (100, 1000) and b.batch == (1, 3)
    assert b.context_bucket(33) == 64 and b.token_bucket(101) == 1000 and b.batch_bucket(2) == 3
    assert b.shapes() == [("context", 1, 32), ("context", 1, 64), ("context", 3, 32), ("context", 3, 64),
                          ("token", 1, 100), ("token", 1, 1000), ("token", 3, 100), ("token", 3, 1000)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_seq_len=512, context=[]), "context-encoding buckets are empty"),
    (dict(max_seq_len=512, context=[0, 8]), "context-encoding bucket 0 must be a positive integer"),
    (dict(max_seq_len=512, token=[64, 2.5]), r"token-generation bucket 2.5 must be a positive integer"),
    (dict(max_seq_len=512, context=[1024]),
     r"context-encoding bucket 1024 exceeds the largest token-generation bucket \(512\)"),
    (dict(token=[600], max_positions=512),
     r"token-generation bucket 600 exceeds the model's max_position_embeddings \(512\)"),
    (dict(max_seq_len=1024, max_positions=512), r"seq_len \(1024\) exceeds the model's max_position_embeddings"),
    (dict(), "give max_seq_len or a list of token-generation buckets"),
    (dict(max_seq_len=0), r"max_seq_len \(0\) must be a positive integer"),
])
def test_bad_bucket_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Buckets.build(**kwargs)


def test_a_prefill_bucket_larger_than_the_cache_is_refused():
    with pytest.raises(ValueError, match=r"largest context-encoding bucket \(256\) exceeds the largest "
                                         r"token-generation bucket \(128\)"):
        Buckets(context=(256,), token=(128,))


def test_request_shape_pads_batch_prompt_and_cache():
    b = Buckets.build(max_context_length=512, max_seq_len=1024, max_batch_size=8)
    # prompt 128 + 128 new tokens: prefill bucket 128, cache bucket 256
    assert request_shape(b, [128], 128) == RequestShape(batch=1, context=128, cache=256)
    # 3 prompts -> batch bucket 4; the cache holds the padded prefill even for few new tokens
    assert request_shape(b, [5, 200, 9], 4) == RequestShape(batch=4, context=256, cache=256)
    assert request_shape(b, [100], 28) == RequestShape(batch=1, context=128, cache=128)


def test_request_past_the_largest_buckets_names_the_lengths():
    b = Buckets.build(max_context_length=256, max_seq_len=512)
    with pytest.raises(ValueError, match=r"prompt length \(257\) is longer than the largest context-encoding "
                                         r"bucket \(256\)"):
        request_shape(b, [10, 257], 1)
    with pytest.raises(ValueError, match=r"longest prompt \(200\) \+ max_new_tokens \(400\) = 600 is longer than "
                                         r"the largest token-generation bucket \(512\)"):
        request_shape(b, [200], 400)
    # at the edge: exactly the largest bucket fits, one token past it is named as the sum
    assert request_shape(b, [256], 256) == RequestShape(batch=1, context=256, cache=512)
    with pytest.raises(ValueError, match=r"longest prompt \(256\) \+ max_new_tokens \(257\) = 513 is longer than "
                                         r"the largest token-generation bucket \(512\); lower max_new_tokens"):
        request_shape(b, [256], 257)


def test_parse_and_round_trip():
    assert parse_buckets("128, 256,512") == (128, 256, 512)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_buckets("128,abc")
    b = Buckets.build(max_seq_len=300, max_batch_size=2)
    assert Buckets.from_dict(b.to_dict()) == b
    with pytest.raises(ValueError, match="needs lists"):
        Buckets.from_dict({"context": [128]})
    assert normalize_buckets([5, 3], "x") == (3, 5)

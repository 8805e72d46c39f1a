"""GET /health and /ping answer anyone (load balancers' probes send no key): with an API key set
their body leaves the served model's name out, which /v1/models and a model_not_found refusal tell
only to a client with the key; without a key it is named as before."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.test_tokenize_routes import MODEL, replica


@pytest.mark.parametrize("api_key, named", [("k", {}), (None, {"model": MODEL})], ids=["keyed", "open"])
def test_health_names_the_model_only_where_no_key_guards_it(smollm2_tokenizer, api_key, named):
    server = replica(smollm2_tokenizer, api_key=api_key)
    for state, status, word in (("serving", 200, "ok"), ("failed", 503, "failed")):
        server.launcher = SimpleNamespace(replica_status=lambda state=state: [{"state": state}], shutdown=lambda: None)
        for probe in (server.health, server.ping):
            answered = probe()
            assert (answered.status_code, json.loads(answered.body)) == (status, {"status": word, **named})

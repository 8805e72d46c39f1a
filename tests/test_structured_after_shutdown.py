"""A structured-output request to a server replica whose Launcher is shut down is refused as any other
request there is: 503 model_unavailable with Retry-After, counted in corelaunch_requests_total. The
structured-output check reaches the launcher before the stream does, and its LaunchError was a plain
500 the metrics never saw. The server's class runs over the demo model's real Launcher, started with
its group in-process (tests/in_process_cluster.py) and shut down (tests/test_tokenize_routes.py's
scripted_server supplies the replica's other fields)."""

from __future__ import annotations

from launcher.api import Launcher
from launcher.serving.openai_app import UNAVAILABLE_RETRY_S
from shardlib.demo_model import ensure_demo_model
from tests.test_tokenize_routes import MODEL, refusal_of, scripted_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
STRUCTURED = {**CHAT, "response_format": {"type": "json_object"}}


def test_a_structured_request_after_shutdown_is_a_counted_503_as_a_plain_one_is(smollm2_tokenizer,
                                                                                 in_process_cluster):
    launcher = Launcher(model=str(ensure_demo_model()), tp=1, compile=False, progress=False, max_num_seqs=2,
                        seq_len=256)
    launcher.start()
    launcher.shutdown()  # as a Serve replica's launcher is while it stops
    server = scripted_server(smollm2_tokenizer, "unused")
    server.launcher = launcher
    plain, structured = (refusal_of(server, "/v1/chat/completions", body) for body in (CHAT, STRUCTURED))
    assert (structured.status, structured.code, structured.headers) == (
        503, "model_unavailable", {"Retry-After": str(UNAVAILABLE_RETRY_S)}), structured.message
    assert structured.message == plain.message and "cannot take requests now" in structured.message
    assert ('corelaunch_requests_total{finish_reason="unavailable",status="503"} 2.0'
            in server.metrics.render().decode())

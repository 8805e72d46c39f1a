"""`corelaunch serve` names why its replicas failed to start: serve.run says only "Failed to update
the deployments ['OpenAIServer']", and the reason was left in the ServeController's traceback far
above the command's last line. Serve's own status types carry the message in the shape Ray 2.60's
controller writes it (the traceback below is one a replica's broken tokenizer produced)."""

from __future__ import annotations

import threading
import time

from launcher.cli.serve_failure import exception_lines, failed_deployments, replica_failure

# Serve's deployment message: its sentence, then the replica's RayTaskError text
SERVE_MESSAGE = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
    "initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:corelaunch:OpenAIServer.initialize_and_get_metadata()\x1b[39m (pid=3407, "
    "ip=192.0.2.2, actor_id=c7f6e13e04dc9ed021acfc0601000000)\n"
    '  File "/venv/lib/python3.11/site-packages/ray/serve/_private/replica.py", line 1867, in initialize\n'
    "    await self._user_callable_wrapper.initialize_callable()\n"
    '  File "/work/main/launcher/api.py", line 1488, in load_tokenizer\n'
    '    raise ValueError(f"the tokenizer in {model_dir} cannot be loaded ({type(error).__name__}: {error}); "\n'
    "ValueError: the tokenizer in /models/m cannot be loaded (JSONDecodeError: Expecting value: line 51 column 2 "
    "(char 1000)); repair or replace its tokenizer files\n"
    "(replica 1 of 2)\n")


def _status(deployments: dict):
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    overviews = {name: DeploymentStatusOverview(status=getattr(DeploymentStatus, state),
                                                status_trigger=DeploymentStatusTrigger.REPLICA_STARTUP_FAILED,
                                                replica_states={}, message=message)
                 for name, (state, message) in deployments.items()}
    app = ApplicationStatusOverview(status=ApplicationStatus.DEPLOY_FAILED,
                                    message=f"Failed to update the deployments {list(deployments)}.",
                                    last_deployed_time_s=0.0, deployments=overviews)
    return ServeStatus(applications={"corelaunch": app})


def test_the_exception_is_read_from_the_traceback_serve_keeps():
    status = _status({"OpenAIServer": ("DEPLOY_FAILED", SERVE_MESSAGE)})
    assert failed_deployments(status, "corelaunch") == [
        "ValueError: the tokenizer in /models/m cannot be loaded (JSONDecodeError: Expecting value: line 51 column 2 "
        "(char 1000)); repair or replace its tokenizer files (replica 1 of 2)"]
    assert failed_deployments(status, "other-app") == []


def test_healthy_deployments_and_messages_without_a_traceback():
    status = _status({"Healthy": ("HEALTHY", ""), "OpenAIServer": ("DEPLOY_FAILED", "  placement never fitted  ")})
    assert failed_deployments(status, "corelaunch") == ["placement never fitted"]


def test_exception_lines_of_a_text_with_nothing_indented_is_the_whole_text():
    assert exception_lines("RuntimeError: boom\nsecond line") == "RuntimeError: boom second line"
    assert exception_lines('Traceback:\n  File "x", line 1\nKeyError: 3') == "KeyError: 3"


def test_a_serve_that_cannot_answer_leaves_serves_own_error():
    class Refusing:
        @staticmethod
        def status():
            raise ConnectionError("controller gone")

    assert replica_failure(Refusing, "corelaunch") is None
    released = threading.Event()

    class Hanging:
        @staticmethod
        def status():
            released.wait(30)

    started = time.monotonic()
    try:
        assert replica_failure(Hanging, "corelaunch", wait_s=0.2) is None
        assert time.monotonic() - started < 5
    finally:
        released.set()
    assert replica_failure(type("Answering", (), {"status": staticmethod(
        lambda: _status({"OpenAIServer": ("DEPLOY_FAILED", SERVE_MESSAGE)}))}), "corelaunch").startswith(
        "ValueError: the tokenizer in /models/m cannot be loaded")


def _traceback_of(error: Exception) -> str:
    """The text Python prints for `error` raised two frames down, the last frame's source line marked
    with carets (Python marks a statement that shares its line)."""
    import traceback

    def load():
        tries = 3; raise error  # noqa: E702, F841 - the raise shares its line: carets under it

    def initialize():
        return load() or None

    try:
        initialize()
    except Exception as raised:  # noqa: BLE001 - formatted as Serve keeps it
        return "".join(traceback.format_exception(raised))
    raise AssertionError("not raised")


def test_an_exception_with_indented_lines_is_read_whole():
    """The exception was taken to start after the last indented line: a message listing each rank's
    share came back as its last line alone ("lower --seq-len")."""
    text = _traceback_of(ValueError("needs 12 GB:\n  rank 0: 6 GB\n  rank 1: 6 GB\nlower --seq-len"))
    assert "^^^^\nValueError: needs 12 GB:\n  rank 0" in text, text  # the last frame's carets, then the message
    assert exception_lines(text) == "ValueError: needs 12 GB: rank 0: 6 GB rank 1: 6 GB lower --seq-len"


def test_a_refused_plan_is_read_whole_from_serves_message():
    """A PlanRejected ends with its "  [code] ..." lines (launch_plan.py): nothing after the last
    indented line, so the whole traceback came back on one line."""
    from launcher.errors import PlanRejected

    errors = [{"code": "seq_len_too_long", "message": "seq_len (9000) exceeds max_position_embeddings (8192)"},
              {"code": "kv_cache_too_large", "message": "the KV cache needs 40 GiB per rank; 24 GiB fit"}]
    lines = "\n".join(f"  [{e['code']}] {e['message']}" for e in errors)
    text = _traceback_of(PlanRejected(f"the layout is impossible; nothing was started:\n{lines}", errors))
    message = "The deployment failed to start 3 times in a row. See controller logs for details. Error:\n" + text
    status = _status({"OpenAIServer": ("DEPLOY_FAILED", message)})
    assert failed_deployments(status, "corelaunch") == [
        "launcher.errors.PlanRejected: the layout is impossible; nothing was started: "
        "[seq_len_too_long] seq_len (9000) exceeds max_position_embeddings (8192) "
        "[kv_cache_too_large] the KV cache needs 40 GiB per rank; 24 GiB fit"]

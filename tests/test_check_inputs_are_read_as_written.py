"""`corelaunch check`'s inputs and messages, without a model or Ray: --prompt-ids as the user wrote
them, an --expected file that is odd or unreadable refused in corelaunch's words, a request failure
under --json still an object on stdout, and infinite errors shown as the README says."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from launcher.cli import check_command, main
from launcher.cli.check_command import load_expected, parse_prompt_ids


def test_prompt_ids_separated_by_spaces_are_refused_not_joined_into_one_id():
    """"5 17 42" lost its spaces and became the one id 51742 ("outside the vocabulary", or worse,
    a valid token the user never meant)."""
    assert parse_prompt_ids("5,17,42") == [5, 17, 42]
    assert parse_prompt_ids(" 5, 17 ,42 ") == [5, 17, 42]  # spaces beside a comma are harmless
    for text in ("5 17 42", "5, 17 42", "5\t17"):
        with pytest.raises(ValueError) as refused:
            parse_prompt_ids(text)
        message = str(refused.value)
        assert f"--prompt-ids {text!r}" in message and "without commas" in message, message
    with pytest.raises(ValueError, match=r"e\.g\. --prompt-ids 5,17,42$"):  # the value, rewritten as it must be
        parse_prompt_ids("5 17 42")


@pytest.mark.parametrize("tokens", [["a", "b"], [[1, 2], [3]], [[None, 1]], [[1, "x"]]])
def test_expected_tokens_torch_cannot_read_are_refused_naming_the_file_and_key(tmp_path, tokens):
    """torch's bare words ("too many dimensions 'str'", "expected sequence of length 2 at dim 1
    (got 1)") named neither; a None among them was a RuntimeError, a traceback."""
    path = tmp_path / "hand_written.pt"
    torch.save({"input_ids": [[5, 17]], "expected_tokens": tokens}, path)
    with pytest.raises(ValueError) as refused:
        load_expected(str(path))
    assert str(refused.value) == (f"{path}: expected_tokens must be an integer (batch, n) or (n,) tensor or a "
                                  f"list of equal-length lists of ints")


def test_an_expected_path_that_is_not_a_regular_file_is_not_called_missing(tmp_path):
    with pytest.raises(ValueError, match="expected-outputs file /dev/null is not a regular file"):
        load_expected("/dev/null")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # torch.load would wait on it for a writer
    with pytest.raises(ValueError, match="is not a regular file"):
        load_expected(str(fifo))
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a missing one still is
        load_expected(str(tmp_path / "missing.pt"))


def test_an_unreadable_expected_file_is_not_called_damaged(tmp_path, monkeypatch):
    """Tests run as root here, for whom chmod 000 changes nothing: torch.load raises as open() would."""
    path = tmp_path / "ref.pt"
    torch.save({"input_ids": [[5]], "expected_tokens": [[1]]}, path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(ValueError) as refused:
        load_expected(str(path))
    message = str(refused.value)
    assert f"expected-outputs file {path} cannot be read: permission denied" in message, message
    assert "damaged" not in message


def test_a_request_failure_under_json_still_prints_an_object_whose_passed_is_false(monkeypatch, capsys):
    """A failed comparison prints its report (exit 1); a request that failed on corelaunch's side
    (exit 1 too) left stdout empty, nothing for `| jq .passed` to read."""
    from launcher.errors import RequestFailed

    def request_fails(args):
        raise RequestFailed("choosing the next token raised: NaN logits")

    monkeypatch.setattr(check_command, "_run", request_fails)
    capsys.readouterr()
    code = main(["check", "--json", "--quiet", "--prompt-ids", "5"])
    out = capsys.readouterr()
    assert code == 1 and "corelaunch check: FAILED: choosing the next token raised" in out.err
    assert json.loads(out.out) == {"passed": False, "error": "choosing the next token raised: NaN logits"}
    code = main(["check", "--quiet", "--prompt-ids", "5"])  # the text form keeps stdout for the report alone
    out = capsys.readouterr()
    assert code == 1 and out.out == ""


def test_check_help_names_every_exit_code():
    from launcher.cli import build_parser

    description = " ".join(build_parser().subcommand_parsers["check"].description.split())
    assert "Exit 0 on pass, 1 on fail, 2 on bad input, 3 when the run itself failed" in description


def test_an_infinite_relative_error_reads_not_finite_in_the_failure_lines():
    """A group whose expected logits are all 0 has no scale: an error past atol is an infinite relative
    error, "not finite" in the group table but "rel error inf" in the first failure's lines."""
    from shardlib.evaluation.accuracy import check_position

    expected = torch.zeros(8)
    actual = expected.clone()
    actual[3] = 1.0
    check = check_position(expected, actual, expected_token=0, actual_token=0, tol_map={None: (1e-5, 0.01)})
    assert math.isinf(check.groups[0].max_rel_error)
    [line] = check.failures()
    assert "all rel error not finite > rtol 0.01" in line, line

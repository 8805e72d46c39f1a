"""`corelaunch serve`'s numeric flags refuse text in their own words: --target-ongoing-requests said
argparse's generic "invalid float value: 'abc'", where --ready-timeout and --burst-wait-ms say what
they take."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("flag, text, said", [
    ("--target-ongoing-requests", "abc", "--target-ongoing-requests ('abc') must be a number (requests in flight "
                                         "per replica that Serve scales toward; default 2)"),
    ("--ready-timeout", "abc", "--ready-timeout ('abc') must be a number of seconds"),
    ("--burst-wait-ms", "abc", "--burst-wait-ms ('abc') must be a number of milliseconds"),
])
def test_a_numeric_flag_given_text_says_what_it_takes(capsys, ray_tripwire, flag, text, said):
    from launcher.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["serve", flag, text])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and said in err, err
    assert "invalid float value" not in err


def test_a_number_is_taken_as_given():
    import argparse

    from launcher.cli import serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--target-ongoing-requests", "1.5"]).target_ongoing_requests == 1.5
    assert parser.parse_args(["serve"]).target_ongoing_requests is None  # the builder's default (2) applies

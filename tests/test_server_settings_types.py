"""launcher/serving/server_settings.py: a text argument that a serve deploy config's YAML read as a
number, a truth value or a date (left unquoted) is refused naming the type and the fix: the key's
refusal said only "must be a non-empty string of printable ASCII without spaces", which an
`api_key: 12345` in the YAML seemed to be."""

from __future__ import annotations

import datetime

import pytest
import yaml

from launcher.serving.server_settings import FREE_TEXT_ARGS, TEXT_ARGS, settings_from_args

DEPLOY_ARGS = """
api_key: 12345
served_model_name: 2024
model: 2024-01-01
presharded_dir: yes
tool_call_parser: yes
dtype: 1.5
"""
"""A serve deploy config's `args:`, as Serve gives them to the builder: YAML's types, not text."""


def _args(key: str) -> dict:
    return {key: yaml.safe_load(DEPLOY_ARGS)[key]}


def test_an_unquoted_key_is_refused_naming_its_type_not_its_value():
    with pytest.raises(ValueError) as refused:
        settings_from_args(_args("api_key"))
    assert str(refused.value) == "api_key must be text (got an int: quote it in the YAML)"
    assert "12345" not in str(refused.value)  # a secret, never shown


@pytest.mark.parametrize("key, message", [
    ("served_model_name", "served_model_name (2024) must be text (got an int: quote it in the YAML)"),
    ("model", "model (datetime.date(2024, 1, 1)) must be text (got a date: quote it in the YAML)"),
    ("presharded_dir", "presharded_dir (True) must be text (got a bool: quote it in the YAML, which reads an "
                       "unquoted true, false, yes, no, on or off as one)"),
])
def test_other_unquoted_text_arguments_are_refused_naming_their_type(key, message):
    with pytest.raises(ValueError) as refused:
        settings_from_args(_args(key))
    assert str(refused.value) == message


@pytest.mark.parametrize("key", FREE_TEXT_ARGS)
def test_every_free_text_argument_refuses_a_number_the_same_way(key):
    for value in (7, True, 0.5, datetime.date(2024, 1, 1)):
        with pytest.raises(ValueError, match=r"must be text \(got an? (int|bool|float|date)[:)]"):
            settings_from_args({key: value})


def test_quoted_the_same_values_are_taken():
    quoted = yaml.safe_load('api_key: "12345"\nserved_model_name: "2024"\npresharded_cache: true\npresharded_cache_dir: "2024"\n')
    settings = settings_from_args(quoted)
    assert (settings.api_key, settings.served_model_name) == ("12345", "2024")
    assert settings.launch["presharded_cache_dir"] == "2024"


@pytest.mark.parametrize("key", [key for key in TEXT_ARGS if key not in FREE_TEXT_ARGS])
def test_an_argument_of_a_few_names_given_a_number_lists_the_names(key):
    """A choice's own refusal lists what it takes, which says more than the type."""
    for value in (7, True, 0.5, datetime.date(2024, 1, 1)):
        with pytest.raises(ValueError, match=r"one of \w|use f8e4m3") as refused:
            settings_from_args({key: value})
        assert "must be text" not in str(refused.value)


def test_unquoted_parser_and_dtype_in_a_deploy_config_name_their_choices():
    with pytest.raises(ValueError, match=r"tool_call_parser \(True\) must be one of hermes"):
        settings_from_args(_args("tool_call_parser"))
    with pytest.raises(ValueError, match=r"unknown dtype 1.5; use one of float32"):
        settings_from_args(_args("dtype"))

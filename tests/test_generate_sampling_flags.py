"""`corelaunch generate`'s sampling flags read as SamplingParams does: a filter given at its "off"
value (--top-k 0, --top-p 1, --min-p 0) asks for no sampling, as top_k=0 in the API is greedy."""

from __future__ import annotations

import argparse

import pytest

from launcher.cli import generate_command, main
from shardlib.sampling_params import SamplingParams


def cli_sampling(*flags: str) -> SamplingParams:
    """The SamplingParams `corelaunch generate FLAGS hi` builds (no Ray: the flags alone)."""
    parser = argparse.ArgumentParser()
    generate_command.add_parser(parser.add_subparsers())
    return generate_command._sampling(parser.parse_args(["generate", *flags, "hi"]))


@pytest.mark.parametrize("flags, api", [(("--top-k", "0"), {"top_k": 0}), (("--top-p", "1"), {"top_p": 1.0}),
                                        (("--min-p", "0"), {"min_p": 0.0})], ids=["top-k", "top-p", "min-p"])
def test_a_filter_at_its_off_value_stays_greedy_as_the_api_does(flags, api):
    """It sampled the whole vocabulary at temperature 1 (any of these flags switched sampling on)."""
    got = cli_sampling(*flags)
    assert got.is_greedy and got.temperature == 0.0
    assert got == SamplingParams(**api)  # the API's reading of the same values


@pytest.mark.parametrize("flags, api", [(("--top-k", "5"), {"top_k": 5}), (("--top-p", "0.9"), {"top_p": 0.9}),
                                        (("--min-p", "0.1"), {"min_p": 0.1}),
                                        (("--top-k", "0", "--top-p", "0.9"), {"top_k": 0, "top_p": 0.9})],
                         ids=["top-k", "top-p", "min-p", "top-k-off-top-p-on"])
def test_a_filter_that_filters_still_samples_at_temperature_1(flags, api):
    got = cli_sampling(*flags)
    assert not got.is_greedy and got.temperature == 1.0
    assert got == SamplingParams(**api)


@pytest.mark.parametrize("off, api", [(("--top-k", "0"), {"top_k": 0}), (("--top-p", "1"), {"top_p": 1.0}),
                                      (("--min-p", "0"), {"min_p": 0.0})], ids=["top-k", "top-p", "min-p"])
def test_a_seed_beside_a_filter_at_its_off_value_is_refused_as_a_seed_alone(off, api, capsys, ray_tripwire):
    """`--top-k 0 --seed 3` was accepted (sampled at temperature 1), where SamplingParams(top_k=0,
    seed=3) is refused: greedy takes no seed."""
    with pytest.raises(ValueError, match=r"^seed=3 seeds sampling, and nothing asks for sampling"):
        SamplingParams(**api, seed=3)
    capsys.readouterr()
    assert main(["generate", *off, "--seed", "3", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--seed (3) seeds sampling, and no sampling flag is given" in err
    assert "add --temperature T, or --top-k K > 0, --top-p P < 1 or --min-p M > 0" in err and err.count("\n") == 1


def test_a_seed_with_a_filter_that_filters_is_taken():
    got = cli_sampling("--top-k", "5", "--seed", "3")
    assert (got.temperature, got.top_k, got.seed) == (1.0, 5, 3)


def test_seed_minus_1_is_no_seed_as_the_api_reads_it():
    """--seed -1 with a temperature seeded every prompt with -1 (the API reads -1 as no seed), and
    alone it was refused as a seed without sampling."""
    assert cli_sampling("--temperature", "0.8", "--seed", "-1") == SamplingParams(temperature=0.8)
    assert cli_sampling("--seed", "-1").is_greedy

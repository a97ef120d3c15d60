"""benchmarks/peers.py: a strop system may carry overrides (``strop-jax+key=value,...``),
run as the same job with them and reported against its base."""

from __future__ import annotations

import argparse

import pytest
from benchmarks import peers


@pytest.mark.parametrize(
    "name", ["strop-jax", "tunix", "strop-torch+ppo.share_prompts=false,ppo.pack=true"]
)
def test_known_systems_and_strop_variants_are_accepted(name):
    assert peers.system_name(name) == name
    assert peers.base_system(name) == name.partition("+")[0]


@pytest.mark.parametrize("name", ["strop-jx", "trl+ppo.pack=false", "strop-jax+ppo.pack"])
def test_unknown_systems_peer_variants_and_bare_keys_are_refused(name):
    with pytest.raises(argparse.ArgumentTypeError, match="not one of"):
        peers.system_name(name)


def test_a_variant_is_reported_against_its_base(capsys):
    def run(seconds: float) -> dict:
        return {"seconds": [9.0, seconds, seconds], "reward": [0.5], "others_cpu": 0.0,
                "phases": {phase: 0.1 for phase in peers.PHASES}}  # fmt: skip

    results = {"strop-jax": [run(1.0)], "strop-jax+ppo.share_prompts=false": [run(2.0)]}
    peers.summarize(results, peers.demo_config())
    out = capsys.readouterr().out
    assert "strop-jax/strop-jax+ppo.share_prompts=false: 0.50x" in out
    assert "strop-jax+ppo.share_prompts=false against strop-jax: ppo.share_prompts=false" in out

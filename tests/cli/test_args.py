"""The shared flags of the commands (`tpfuse.cli.args`): `--preset` and `--hidden` give the hidden
sizes, the model presets' and the benchmarks' `tiny`."""

import argparse

from tpfuse.cli.args import hiddens


def test_presets_give_the_hidden_sizes():
    args = argparse.Namespace(preset=["glm5", "qwen3-235b", "glm5"], hidden=[4096, 512], max_tokens=8)
    assert hiddens(args, "tune") == (6144, 4096, 512)


def test_tune_takes_the_tiny_preset_of_the_benchmarks():
    assert hiddens(argparse.Namespace(preset=["tiny"], hidden=[], max_tokens=4), "tune") == (64,)

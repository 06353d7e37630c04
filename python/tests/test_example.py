"""examples/train_char_lm.py for a few steps: the loss goes down and the recurrent sampler runs."""
import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_char_lm.py"


@pytest.mark.parametrize("method", ["elu", "favor"])
def test_char_lm_loss_goes_down(method):
    spec = importlib.util.spec_from_file_location("train_char_lm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    lines = []
    losses = example.train(method, example.corpus(), steps=20, batch=8, context=64, log=lines.append)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert any("sample (recurrent)" in line for line in lines)

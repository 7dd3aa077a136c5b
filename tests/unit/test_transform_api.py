"""tfhybrid.transform / gather / describe in one process (a world of one rank):
the rewrite computes the original function, gather returns a plain Keras
model that loads without tfhybrid, auto asks the oracle, errors are clear."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tfhybrid.compose import transform
from tfhybrid.transformer import describe, gather

sys.path.insert(0, os.path.dirname(__file__))
from test_transform_planner import cnn


@pytest.mark.parametrize("strategy", ["d", "f", "c", "s", "df", "ds", "gmp"])
def test_transform_computes_the_original_function(strategy):
    model = cnn(classes=8)
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype("float32")
    pmodel = transform(model, strategy)
    np.testing.assert_allclose(pmodel(x), model(x), rtol=1e-5, atol=1e-6)
    assert pmodel._tfhybrid_batch_split == ("world" if strategy in ("d", "gmp") else "data")


def test_gather_saves_a_plain_keras_model(tmp_path):
    model = cnn()
    full = gather(transform(model, "f"))
    for a, b in zip(full.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    path = str(tmp_path / "m.keras")
    full.save(path)
    code = ("import keras, sys; m = keras.saving.load_model(sys.argv[1]); "
            "assert 'tfhybrid' not in sys.modules; print(len(m.layers))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(len(model.layers))


def test_describe_prints_every_layer():
    lines = []
    d = describe(transform(cnn(), "d"), print_fn=lines.append)
    assert d.param_bytes == 4 * sum(int(np.prod(w.shape)) for w in cnn().trainable_weights)
    assert all(name in lines[0] for name in ("conv1", "bn1", "fc1", "out"))


def test_auto_uses_the_oracle():
    pmodel = transform(cnn(), "auto", batch_size=8, fallback="replicate")
    assert pmodel._tfhybrid_transform.plan.strategy in ("d", "f", "c", "s", "df", "ds", "gmp")


def test_auto_needs_a_batch_size():
    with pytest.raises(ValueError, match=r"strategy='auto' needs the global batch size"):
        transform(cnn(), "auto")
    with pytest.raises(ValueError, match=r"batch_size=0"):
        transform(cnn(), "auto", batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size=8 does not apply to strategy 'd'"):
        transform(cnn(), "d", batch_size=8)


def test_errors_reach_the_public_api():
    with pytest.raises(ValueError, match=r"unknown strategy"):
        transform(cnn(), "p2p")
    with pytest.raises(ValueError, match=r"not returned by tfhybrid.transform"):
        gather(cnn())

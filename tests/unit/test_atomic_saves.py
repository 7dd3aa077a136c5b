"""gather's models save through a file of their own renamed onto the path
(every rank saves the same gathered model, often to one path)."""
import os

import keras
import numpy as np
import pytest

from tfhybrid.transformer.gather import atomic_saves


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])


def test_save_and_save_weights_land_whole_on_the_path(tmp_path):
    model = atomic_saves(_model())
    model.save(tmp_path / "m.keras")
    model.save_weights(str(tmp_path / "m.weights.h5"))
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]     # no part files
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    other = _model()
    other.layers[0].kernel.assign(np.zeros((3, 2), np.float32))
    other.load_weights(str(tmp_path / "m.weights.h5"))
    for got in (loaded, other):
        for a, b in zip(got.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_a_failed_save_leaves_nothing_and_keras_errors_are_kept(tmp_path):
    model = atomic_saves(_model())
    with pytest.raises(ValueError, match=".keras"):
        model.save(tmp_path / "m.h6")                 # Keras' own suffix check
    assert os.listdir(tmp_path) == []
    with pytest.raises(Exception):
        model.save(tmp_path / "missing" / "m.keras")  # no such directory
    assert os.listdir(tmp_path) == []


def test_overwrite_false_goes_to_keras_as_given(tmp_path, monkeypatch):
    model = atomic_saves(_model())
    path = tmp_path / "m.keras"
    model.save(path)
    monkeypatch.setattr("builtins.input", lambda *_: "n")    # Keras asks before overwriting
    model.save(path, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]

"""ls (Stanza's layer separation) without collectives: roles, worker checks, the cut."""
import keras
import pytest

from tfhybrid.transformer.layer_separation import check_workers, find_cut, roles


def test_roles_and_workers():
    assert roles(3, 1) == ((0, 1, 2), (3,), ((0, 1, 2, 3),))
    assert roles(2, 2) == ((0, 1), (2, 3), ((0, 2), (1, 3)))
    assert check_workers(4, 2) == (2, 2)
    with pytest.raises(ValueError, match=r"fc_workers=3 with 4 ranks.*Use fc_workers in \[1, 2\]"):
        check_workers(4, 3)
    with pytest.raises(ValueError, match="fc_workers=4"):
        check_workers(4, 4)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        check_workers(1, 1)


def test_cut_after_last_conv_or_pool_before_first_dense():
    x = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(2, 3, name="c1")(x)
    h = keras.layers.MaxPooling2D(name="p1")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(4, name="fc")(h)
    _, name = find_cut(keras.Model(x, h))
    assert name == "p1"
    from tfhybrid.transformer.graph import as_functional
    seq = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(2, 3, name="c1"),
                            keras.layers.Flatten(name="flat"), keras.layers.Dense(3, name="fc")])
    assert find_cut(as_functional(seq))[1] == "c1"     # layers shared with the Sequential
    dense_only = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2, name="d0")])
    with pytest.raises(ValueError, match="no convolution or pooling before its first Dense layer 'd0'"):
        find_cut(dense_only)
    with pytest.raises(ValueError, match="no Dense layer"):
        find_cut(keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(1, 3)]))

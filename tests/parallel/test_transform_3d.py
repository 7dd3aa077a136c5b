"""tfhybrid.transform of a volume (Conv3D) CNN under ``s`` and ``ds``: depth,
height or a (pd, ph, pw) block grid, with SyncBatchNormalization over the
spatial blocks, a ZeroPadding3D, a Cropping3D and a MaxPooling3D inside the
spatial region,
trained like the single-process original.

Run under ``horovodrun -np 2`` and ``-np 4``. The reference is ``fit`` of the
unmodified model on the global batches in one process; see
``spatial_fit.check_fit_equals_single_process`` for what is compared.
"""
import keras
import numpy as np
import pytest

from tfhybrid.layers import (SpatialConv3D, SpatialCropping3D, SpatialMaxPooling3D,
                             SpatialZeroPadding3D)

from conftest import randn, rng, world_size
from spatial_fit import check_fit_equals_single_process

N = world_size()
STEPS, BATCH, DEPTH, SIZE, CLASSES = 2, 8, 12, 6, 3


def volume_cnn(seed=0):
    """Conv3D -> BN -> ZeroPadding3D -> Cropping3D -> Conv3D -> MaxPooling3D -> Dense,
    on 12x6x6x2 volumes (padding and cropping re-block across ranks)."""
    keras.utils.set_random_seed(seed)
    i = keras.Input((DEPTH, SIZE, SIZE, 2))
    x = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv1")(i)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ZeroPadding3D(((2, 2), (1, 1), (1, 1)), name="pad")(x)
    x = keras.layers.Cropping3D(((4, 4), (2, 2), (2, 2)), name="crop")(x)
    x = keras.layers.Conv3D(4, 3, padding="same", activation="tanh", name="conv2")(x)
    x = keras.layers.MaxPooling3D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    return keras.Model(i, keras.layers.Dense(CLASSES, activation="softmax", name="out")(x),
                       name="volume_cnn")


def data():
    x = randn((STEPS * BATCH, DEPTH, SIZE, SIZE, 2), "volume", "x")
    y = rng("volume", "y").integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)
    return x, y


# (strategy, model_parallel, options): s over every rank, ds with data groups.
CASES = {2: [("s", 2, {}), ("s", 2, {"spatial": "height"}), ("ds", 1, {})],
         4: [("s", 4, {}), ("s", 4, {"spatial": (2, 2, 1)}), ("ds", 2, {"spatial": "depth"})]
         }.get(N, [])


@pytest.mark.parametrize("strategy,mp,options", CASES,
                         ids=[f"{s}-mp{m}-{o.get('spatial', 'default')}" for s, m, o in CASES])
def test_volume_cnn_fit_equals_single_process(grid_of, strategy, mp, options):
    grid_of(mp)
    check_fit_equals_single_process(
        volume_cnn, *data(), BATCH, strategy, options,
        {"conv1": SpatialConv3D, "pad": SpatialZeroPadding3D, "crop": SpatialCropping3D,
         "pool": SpatialMaxPooling3D})

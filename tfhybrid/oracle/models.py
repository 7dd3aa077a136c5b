"""Known models for ``tfhybrid plan MODEL``: the papers' CNNs built in Keras 3.

* ``vgg16``, ``resnet50``: ``keras.applications`` with ``weights=None`` (224x224x3).
* ``alexnet``: Krizhevsky et al. (ParaDL's AlexNet, 227x227x3 input so the
  11x11/4 first layer yields 55x55; ParaDL's file uses 226 and 54).
* ``splitbrain_vgg``: the VGG variant of SplitBrain Table 1 for CIFAR-10
  (32x32x3; 7 conv layers, FC0 4096x1024, FC1 1024x1024, FC2 1024x10).
* ``cosmoflow``: a small CosmoFlow-like Conv3D network (64^3 x 4 input).

Example:
    >>> build_model("splitbrain_vgg").count_params()   # Table 1: 6.99 M
    6990666
"""
from __future__ import annotations

import os


def _keras():
    import keras  # noqa: WPS433
    return keras


def vgg16():
    """keras.applications.VGG16(weights=None)."""
    return _keras().applications.VGG16(weights=None)


def resnet50():
    """keras.applications.ResNet50(weights=None)."""
    return _keras().applications.ResNet50(weights=None)


def alexnet(num_classes: int = 1000):
    """AlexNet (single tower, no LRN)."""
    L = _keras().layers
    return _keras().Sequential([
        _keras().Input((227, 227, 3)),
        L.Conv2D(96, 11, strides=4, activation="relu", name="conv1"),
        L.MaxPooling2D(3, 2, name="pool1"),
        L.Conv2D(256, 5, padding="same", activation="relu", name="conv2"),
        L.MaxPooling2D(3, 2, name="pool2"),
        L.Conv2D(384, 3, padding="same", activation="relu", name="conv3"),
        L.Conv2D(384, 3, padding="same", activation="relu", name="conv4"),
        L.Conv2D(256, 3, padding="same", activation="relu", name="conv5"),
        L.MaxPooling2D(3, 2, name="pool5"),
        L.Flatten(name="flatten"),
        L.Dense(4096, activation="relu", name="fc6"),
        L.Dropout(0.5, name="drop6"),
        L.Dense(4096, activation="relu", name="fc7"),
        L.Dropout(0.5, name="drop7"),
        L.Dense(num_classes, activation="softmax", name="fc8"),
    ], name="alexnet")


def splitbrain_vgg(num_classes: int = 10):
    """SplitBrain Table 1 VGG variant (kernel counts match the table; biases added)."""
    L = _keras().layers
    conv = [(64, "conv0"), (64, "conv1"), "pool", (128, "conv2"), (128, "conv3"), "pool",
            (256, "conv4"), (256, "conv5"), (256, "conv6"), "pool"]
    layers = [_keras().Input((32, 32, 3))]
    for i, c in enumerate(conv):
        if c == "pool":
            layers.append(L.MaxPooling2D(2, name=f"pool{i}"))
        else:
            layers.append(L.Conv2D(c[0], 3, padding="same", activation="relu", name=c[1]))
    layers += [L.Flatten(name="flatten"),
               L.Dense(1024, activation="relu", name="fc0"),
               L.Dense(1024, activation="relu", name="fc1"),
               L.Dense(num_classes, activation="softmax", name="fc2")]
    return _keras().Sequential(layers, name="splitbrain_vgg")


def cosmoflow(size: int = 64):
    """CosmoFlow-like 3-D CNN (Mathuriya et al.), scaled to a ``size``^3 x 4 cube."""
    L = _keras().layers
    layers = [_keras().Input((size, size, size, 4))]
    for i, f in enumerate((16, 32, 64)):
        layers += [L.Conv3D(f, 3, padding="same", activation="relu", name=f"conv{i + 1}"),
                   L.AveragePooling3D(2, name=f"pool{i + 1}")]
    layers += [L.Flatten(), L.Dense(128, activation="relu", name="fc1"),
               L.Dense(4, name="fc2")]
    return _keras().Sequential(layers, name="cosmoflow")


KNOWN_MODELS = {"vgg16": vgg16, "resnet50": resnet50, "alexnet": alexnet,
                "splitbrain_vgg": splitbrain_vgg, "cosmoflow": cosmoflow}


def build_model(name: str):
    """A known model by name, or a ``.keras`` file loaded with keras.saving.

    Raises:
        ValueError: neither a known name nor an existing .keras file.

    Example:
        >>> build_model("alexnet").name
        'alexnet'
    """
    key = name.lower().replace("-", "_")
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]()
    if name.endswith(".keras"):
        if not os.path.exists(name):
            raise ValueError(f"Model file {name!r} does not exist.")
        return _keras().saving.load_model(name, compile=False)
    raise ValueError(f"Unknown model {name!r}: expected a .keras file or one of "
                     f"{sorted(KNOWN_MODELS)}.")

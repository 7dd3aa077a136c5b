"""Small U-Nets for the spatial strategies (tests, examples and benchmarks).

``unet2d`` and ``unet3d`` build plain Keras U-Nets (no tfhybrid layer):
an encoder of ``depth`` levels (two 3x3 convolutions, BatchNormalization
optional, max pooling), a bottleneck, a decoder that up-samples (a 2x2
transposed convolution with stride 2, or nearest UpSampling + a 3x3
convolution), joins the encoder's skip by ``Concatenate`` and convolves,
and a per-voxel head (1x1 convolution + softmax over ``classes``). Under
``tfhybrid.transform(model, "s")`` every layer runs on spatial blocks:
nothing is at full resolution and the output stays split.

Example:
    >>> model = unet3d((16, 16, 16, 1), classes=3, filters=4, depth=2)
    >>> pmodel = tfhybrid.transform(model, "s")     # horovodrun -np 2
"""
import keras


def _block(x, filters, conv, name, batch_norm, layer_norm=False):
    for j in (1, 2):
        x = conv(filters, 3, padding="same", name=f"{name}_conv{j}")(x)
        if batch_norm:
            x = keras.layers.BatchNormalization(name=f"{name}_bn{j}")(x)
        if layer_norm:
            x = keras.layers.LayerNormalization(name=f"{name}_ln{j}")(x)
        x = keras.layers.Activation("relu", name=f"{name}_relu{j}")(x)
    return x


def unet(input_shape, classes=3, filters=4, depth=2, up="transpose", batch_norm=True,
         seed=0, name=None, head="conv", layer_norm=False):
    """A U-Net on ``input_shape`` (H, W, C) or (D, H, W, C).

    Args:
        input_shape: One sample's shape, channels last; every spatial size
            must be divisible by ``2 ** depth`` (times the ranks splitting it).
        classes: Channels of the per-voxel softmax output.
        filters: Filters of the first level (doubled per level).
        depth: Number of pooling levels.
        up: ``"transpose"`` (ConvNDTranspose(f, 2, strides=2)), ``"transpose3"``
            (kernel 3, stride 2, same: needs a halo) or ``"upsample"``
            (nearest UpSampling + 3x3 convolution).
        batch_norm: BatchNormalization after every 3x3 convolution.
        seed: Keras' random seed for the initial weights.
        head: ``"conv"`` (1x1 convolution) or ``"dense"`` (Dense on every voxel).
        layer_norm: LayerNormalization over channels after every 3x3 convolution.
    """
    keras.utils.set_random_seed(seed)
    ndim = len(input_shape) - 1
    conv = keras.layers.Conv3D if ndim == 3 else keras.layers.Conv2D
    transpose = keras.layers.Conv3DTranspose if ndim == 3 else keras.layers.Conv2DTranspose
    pool = keras.layers.MaxPooling3D if ndim == 3 else keras.layers.MaxPooling2D
    upsample = keras.layers.UpSampling3D if ndim == 3 else keras.layers.UpSampling2D
    inputs = keras.Input(input_shape, name="image")
    x, skips = inputs, []
    for level in range(depth):
        x = _block(x, filters * 2 ** level, conv, f"enc{level}", batch_norm, layer_norm)
        skips.append(x)
        x = pool(2, name=f"pool{level}")(x)
    x = _block(x, filters * 2 ** depth, conv, "mid", batch_norm, layer_norm)
    for level in reversed(range(depth)):
        f = filters * 2 ** level
        if up == "upsample":
            x = upsample(2, name=f"up{level}")(x)
            x = conv(f, 3, padding="same", name=f"up{level}_conv")(x)
        elif up == "transpose3":
            x = transpose(f, 3, strides=2, padding="same", name=f"up{level}")(x)
        else:
            x = transpose(f, 2, strides=2, name=f"up{level}")(x)
        x = keras.layers.Concatenate(name=f"skip{level}")([x, skips[level]])
        x = _block(x, f, conv, f"dec{level}", batch_norm, layer_norm)
    if head == "dense":
        x = keras.layers.Dense(classes, name="head")(x)
    else:
        x = conv(classes, 1, name="head")(x)
    outputs = keras.layers.Activation("softmax", name="softmax")(x)
    return keras.Model(inputs, outputs, name=name or f"unet{ndim}d")


def unet2d(input_shape=(16, 16, 1), **kwargs):
    """A 2-D U-Net (see :func:`unet`)."""
    return unet(input_shape, **kwargs)


def unet3d(input_shape=(8, 8, 8, 1), **kwargs):
    """A 3-D U-Net (see :func:`unet`)."""
    return unet(input_shape, **kwargs)

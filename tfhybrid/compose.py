"""``tfhybrid.transform``: build a strategy's model, then guard it.

The one place where a transformed model is put together: the transformer
builds it (:func:`tfhybrid.transformer.api.build`), the guards install its
``compile``/``fit``/``evaluate``/``predict`` (:func:`tfhybrid.guards.install.install`),
and a model compiled before ``transform`` is compiled again the same way.
``tfhybrid.transform``, :func:`tfhybrid.load` and elastic runs
(:mod:`tfhybrid.elastic`) all come through :func:`transform`.
"""
from __future__ import annotations

from tfhybrid import checkpoint
from tfhybrid.guards.install import install
from tfhybrid.transformer.api import build
from tfhybrid.transformer.parts import PartModel
from tfhybrid.watchdog import collective_api


def transform(model, strategy="d", **options):
    """The hybrid-parallel counterpart of an unmodified Keras model.

    Call on every rank after :func:`tfhybrid.init` (collective). The
    returned model holds this rank's part of global rank 0's current weights
    of ``model`` (copied, or sliced for partitioned layers; transform
    broadcasts them first, so weights restored or initialised on rank 0 only
    reach every rank, also in sharded layers) and computes the same
    function; ``model`` itself is not modified.

    Args:
        model: A built Sequential or Functional Keras 3 model.
        strategy: ``"d"`` (data parallel over all ranks), ``"f"``/``"c"``
            (filter/channel parallelism of every Dense/Conv2D/Conv3D over all ranks:
            init with ``model_parallel=world``), ``"s"`` (spatial split of the
            leading convolutions over all ranks), ``"df"``/``"ds"`` (data
            groups x filter/spatial groups), ``"gmp"`` (SplitBrain: convs data
            parallel over all ranks, FC layers with high CCR partitioned in
            groups of ``mp``), ``"p"`` (GPipe pipeline: ``stages=S`` stages on
            the model groups of ``init(model_parallel=S)``, ``micro_batches=M``;
            data parallel across model groups), ``"ls"`` (Stanza's layer
            separation, ``fc_workers=``) or ``"auto"`` (the oracle's choice).
        **options: ``mp``, ``ccr_threshold``, ``scheme`` (``"BK"``, ``"B"``
            or ``"B/K"``: the ModuloLayer scheme), ``average_every`` and
            ``averaging`` (SplitBrain's periodic model averaging, approximate
            for ``average_every`` > 1) (gmp); ``spatial``,
            ``spatial_layers`` (s/ds); ``layers`` (per-layer overrides
            ``{"fc1": "f", "fc2": "c", "conv1": "replicate"}``); ``fallback``
            (``"error"`` or ``"replicate"``); ``stages``, ``micro_batches``,
            ``machine`` (p); ``fc_workers`` (ls). See
            :class:`~tfhybrid.transformer.options.TransformOptions`.

    Returns:
        A Functional Keras model. Compile it with
        ``tfhybrid.DistributedOptimizer`` and feed it
        ``tfhybrid.data.shard(batches, model=transformed)``.

    Raises:
        ValueError: subclassed/unbuilt models, unknown strategy or options,
            options that do not apply to the strategy, a grid the strategy
            cannot use, a layer that cannot be partitioned, or s/ds on a
            model with no Conv2D they can split (the message names the
            layer, the strategy and the fix).

    Example:
        >>> tfhybrid.init(model_parallel=2)                # horovodrun -np 4
        >>> pmodel = tfhybrid.transform(model, "df")
        >>> pmodel = tfhybrid.transform(model, "gmp", ccr_threshold=100)
        >>> pmodel = tfhybrid.transform(model, "gmp", scheme="B/K")   # K micro-steps
        >>> pmodel = tfhybrid.transform(model, "p", stages=2, micro_batches=4)   # GPipe
        >>> tfhybrid.describe(pmodel)
    """
    new = build(model, strategy, **options)
    return _compiled_like(model, install(new, part=isinstance(new, PartModel)))


@collective_api("tfhybrid.load")
def load(path, strategy=None, compile=True, custom_objects=None, **options):
    """Resume a checkpoint of :func:`tfhybrid.save` on this grid (collective).

    Args:
        path: The ``.keras`` file given to :func:`save`, or the directory
            of a sharded checkpoint (``save(..., sharded=True)``).
        strategy: Strategy to transform for; default the one saved. Any
            strategy and world size work: weights and optimizer slots are
            re-sharded for the new layout. (A sharded checkpoint loaded on
            its own grid and strategy is read rank by rank; otherwise every
            rank consolidates it in memory first.)
        compile: Compile as the model was compiled when saved (optimizer
            with its :class:`tfhybrid.DistributedOptimizer` options, loss,
            metrics, loss weights) and restore the optimizer's slots, counters
            and iteration count. With ``compile=False`` only the weights are
            restored.
        custom_objects: ``{name: class or function}`` for custom layers,
            losses and metrics that are not registered with
            ``keras.saving.register_keras_serializable`` (as
            ``keras.saving.load_model`` takes them).
        **options: ``transform`` options (``mp``, ``spatial``, ``layers``...).

    Returns:
        The transformed model. Its first ``fit`` continues at the saved data
        position (:func:`tfhybrid.checkpoint.resume_fit_at`): with ``initial_epoch`` omitted it
        starts at the saved epoch (when ``epochs`` exceeds it), and in that
        epoch it skips the ``step`` batches trained before the checkpoint,
        so ``model.fit(tfhybrid.data.shard(dataset, model=model), epochs=E)``
        on the same (unshuffled or seeded per epoch) dataset continues as if
        training had never stopped. :func:`tfhybrid.checkpoint.read_meta` gives the saved
        ``epoch`` and ``step``.

    Raises:
        FileNotFoundError: if the checkpoint or its side file is missing.
        ValueError: if ``compile=True`` but the checkpoint has no optimizer
            or loss configuration (load with ``compile=False`` and compile
            yourself; the slots then start from zero).

    Example:
        >>> model = tfhybrid.load("ckpt/last.keras", strategy="df")
        >>> model.fit(tfhybrid.data.shard(batches, model=model), epochs=10)  # saved epoch/step on
    """
    return checkpoint.resume(transform, path, strategy, compile, custom_objects, **options)


def _compiled_like(source, new):
    """Compile ``new`` as ``source`` was compiled (a script that compiles first and
    transforms just before ``fit`` keeps its loss, metrics and optimizer).

    The optimizer goes through the transformed model's ``compile``, which wraps
    a plain one in :class:`tfhybrid.DistributedOptimizer` (with its warning). An
    optimizer that has already trained ``source`` holds slots for ``source``'s
    variables: a fresh copy from its config is used (its step count and slots
    are not carried, as with any newly compiled model).
    """
    holder = getattr(source, "_compile_config", None)
    if not getattr(source, "compiled", False) or holder is None:
        return new
    config = dict(holder.config)
    optimizer = config.get("optimizer")
    if getattr(optimizer, "built", False):
        try:
            copy = type(optimizer).from_config(optimizer.get_config())
            for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
                if hasattr(optimizer, name):      # not in the config; ids of source's
                    setattr(copy, name, getattr(optimizer, name))   # variables: translated
            optimizer = copy                      # at compile
        except Exception as err:
            raise ValueError(
                f"Model {source.name!r} was compiled and trained before tfhybrid.transform, "
                f"and its optimizer ({type(optimizer).__name__}) cannot be copied for the "
                f"transformed model ({type(err).__name__}: {err}). Call compile() on the "
                "transformed model with a new optimizer.") from err
    config["optimizer"] = optimizer
    if config.get("jit_compile") is True:      # resolved from "auto" on the source
        config["jit_compile"] = "auto"
    new.compile(**config)
    return new

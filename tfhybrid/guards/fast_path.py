"""The lean train step: ``fit`` calls the traced step function directly when
Keras' wrapper adds nothing, and reads the dataset once per step."""
from __future__ import annotations

import contextlib
import weakref

import tensorflow as tf


@contextlib.contextmanager
def after_reading(data):
    """A context in which every op of a step waits for the step's batch ``data``.

    Keras' loss tracker and ratio metrics add the batch's row count to their
    ``count`` state, and with a static batch size that count is a constant
    (``tf.shape`` of a fully known shape), so its ``assign_add`` depends on
    nothing the step reads. When a dataset of unknown length ends, the step
    function is called once more and its ``get_next`` raises
    ``OutOfRangeError`` (Keras' end-of-epoch signal), yet the constant
    ``assign_add`` may already have run: every loss and metric of the pass
    (fit's epoch logs, validation, evaluate) then comes out ``n / (n + 1)``
    of its value over ``n`` batches (under Keras 3.15.1 / TF 2.18.1, in one
    process too). Inside this context every op of
    the step, constants included, runs only after the batch was read, so the
    end-of-data call changes no state. Eager steps need no ordering (a no-op).
    Variables the step creates (metrics built at their first update) are
    created outside the context: their initial values are lifted out of the
    traced step and must not depend on its input.
    """
    if tf.executing_eagerly():
        yield
        return

    def without_dependencies(next_creator, **kwargs):
        with tf.control_dependencies(None):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(without_dependencies), tf.control_dependencies(
            [t for t in tf.nest.flatten(data, expand_composites=True) if tf.is_tensor(t)]):
        yield


def lean_train_function(model, keras_function):
    """``fit``'s train function for a transformed model: one ``tf.function``
    that reads the next batch and runs ``train_step`` on it.

    Keras 3 (``steps_per_execution=1``) wraps the same step in an outer
    function returning a ``tf.experimental.Optional`` and then runs two eager
    ops per step (``has_value``, ``get_value``) on it, a cost a small CNN's
    data-parallel step notices. The step itself is
    the same ``train_step`` (bit-identical weights); an exhausted iterator
    raises ``OutOfRangeError``, which Keras' epoch loop treats as the end of
    the data, as it does for its own function. Keras' function is kept
    (returned unchanged) for eager runs, ``steps_per_execution > 1``, XLA
    (the batch is read outside the compiled step), a ``tf.distribute``
    strategy, and any iterator that is not a ``tf.data`` iterator.
    """
    if (model.run_eagerly or model.steps_per_execution != 1 or model.jit_compile
            or tf.distribute.has_strategy() or keras_function is None):
        return keras_function

    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        return model.train_step(iterator.get_next())

    step = tf.function(one_step_on_iterator, reduce_retracing=True, jit_compile=False)
    # The epoch's iterator and its traced step: calling the concrete function skips
    # the polymorphic dispatch (the iterator's type spec canonicalised and hashed
    # on every call). A new iterator (next epoch or
    # fit) looks the step up again, so a new element spec still retraces.
    epoch = {"iterator": None, "step": None}

    def function(iterator):
        if not isinstance(iterator, tf.data.Iterator):
            return keras_function(iterator)
        seen = epoch["iterator"]
        if seen is None or seen() is not iterator:
            # An iterator's first step runs through the tf.function's own call, as
            # Keras' function does: it creates the variables the first trace makes
            # (metrics built at their first update) and, when an initial value
            # depends on the batch (made inside the step, after reading it), falls
            # back to initialising it inside the step. get_concrete_function alone
            # would raise UnliftableError there; after this call it only looks up
            # the step that creates no variables.
            logs = step(iterator)
            epoch["step"] = _flat_caller(step.get_concrete_function(iterator), iterator)
            epoch["iterator"] = weakref.ref(iterator)
            return logs
        return epoch["step"]()

    return function


def _flat_caller(concrete, iterator):
    """A call of ``concrete`` on ``iterator`` with its one flat input, the
    iterator's resource handle (checked once here against the traced signature).

    ``ConcreteFunction.__call__`` binds and type-checks the structured
    arguments on every call (the iterator's spec canonicalised and cast);
    ``_call_flat`` with the same flat tensors runs the same function (TF
    2.18.1, 2.19.1, 2.20.0 and 2.21.0: tests/unit/test_guards.py). Where this
    TensorFlow has no such entry point, or the iterator does not flatten to
    one resource tensor, the structured call is kept.
    """
    call_flat = getattr(concrete, "_call_flat", None)
    handle = getattr(iterator, "_iterator_resource", None)
    try:
        flat = concrete.function_type.unpack_inputs(
            concrete.function_type.bind(iterator))
    except Exception:  # noqa: BLE001 (any other signature: the public call)
        flat = None
    if (call_flat is None or handle is None or flat is None or len(flat) != 1
            or flat[0] is not handle):
        return lambda: concrete(iterator)
    captured = concrete.captured_inputs
    return lambda: call_flat([handle], captured)

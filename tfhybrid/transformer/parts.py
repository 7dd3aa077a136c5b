"""What the models of ``p`` and ``ls`` (ranks running different parts) share:
the :class:`PartModel` interface and the global ``evaluate``."""
from __future__ import annotations

import inspect

import keras


class PartModel(keras.Model):
    """A model whose ranks run different parts of the original model: ``p``
    (pipeline stages) and ``ls`` (Stanza's CONV and FC workers).

    Planned strategies keep one Functional model on every rank, described by
    its :class:`~tfhybrid.transformer.api.TransformInfo`; these models train
    with their own step instead, and answer what ``describe``, ``gather``,
    ``save`` and the guards ask through this interface.

    Attributes:
        tfhybrid_strategy: ``"p"`` or ``"ls"``.
    """

    tfhybrid_strategy: str = ""

    def gathered(self):
        """The plain original architecture with the trained weights (collective)."""
        raise NotImplementedError

    def optimizer_state(self):
        """The optimizer state at full shapes for ``tfhybrid.save`` (collective):
        ``{"iterations", "slots": {name: [array per trainable weight of the plain
        model]}}``, or None before the optimizer is built."""
        raise NotImplementedError

    def bytes_moved(self, local_batch):
        """Bytes this rank sends per training step, by kind."""
        raise NotImplementedError

    def describe_parts(self, batch_size, description_cls):
        """``tfhybrid.describe`` of this model: its parts, their layers, bytes per step."""
        raise NotImplementedError


def evaluate_global(model, keras_evaluate, args, kwargs):
    """Keras ``evaluate`` of ``model`` returning the metrics Keras' ``evaluate``
    returns after summing the states over the ranks (``get_metrics_result``).

    ``return_dict`` may come by keyword or by position: fit's validation calls
    ``evaluate(..., return_dict=True)``, which the guards pass on positionally
    (a bound signature), and a second ``return_dict=True`` here failed with
    "got multiple values for argument 'return_dict'" on some ranks, the others
    waiting in the evaluate's collectives.
    """
    bound = inspect.signature(keras.Model.evaluate).bind(model, *args, **kwargs)
    return_dict = bool(bound.arguments.pop("return_dict", False))
    bound.arguments["return_dict"] = True
    keras_evaluate(*bound.args[1:], **bound.kwargs)     # states summed at its end
    logs = {k: float(v) for k, v in model.get_metrics_result().items()}
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values

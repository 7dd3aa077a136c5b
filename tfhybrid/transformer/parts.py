"""What the models of ``p`` and ``ls`` (ranks running different parts) share."""
from __future__ import annotations

import inspect

import keras


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

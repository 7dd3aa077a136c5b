"""auto and plan never offer what transform cannot build: one
feasibility check, the transformer's planner on a hypothetical grid."""
import os

import keras
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfhybrid
from tfhybrid.oracle import rank
from tfhybrid.transformer.feasibility import check_predictions, refusal

MACHINE = {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e10}


def text_model():
    return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(100, 8),
                             keras.layers.LSTM(4), keras.layers.Dense(2)], name="text")


def cnn():
    return keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3, padding="same"),
                             keras.layers.Flatten(), keras.layers.Dense(8),
                             keras.layers.Dense(4)], name="cnn")


def test_refusal_is_transforms_error_message():
    model = text_model()
    assert refusal(model, "d", 4, 1) is None
    why = refusal(model, "c", 4, 4)
    assert "Embedding" in why and "fallback='replicate'" in why
    assert refusal(model, "p", 4, 2) is None       # Embedding | LSTM | Dense: 2 cut points
    assert "stages=4 for model 'text', which can be cut at only 2 places" in refusal(
        model, "p", 4, 4)
    assert "does not build strategy 'serial'" in refusal(model, "serial", 4, 1)
    assert "strategy='ls'" in refusal(model, "ls", 4, 2)


def test_transform_error_in_one_process_matches_refusal():
    """On a world of one, c over a group of 1 refuses the Embedding the same way."""
    tfhybrid.init()
    model = text_model()
    with pytest.raises(ValueError) as err:
        tfhybrid.transform(model, "c")
    assert str(err.value) == refusal(model, "c", 1, 1)


@pytest.mark.parametrize("p,k", [(4, 1), (4, 2), (4, 4), (2, 2)])
def test_plan_marks_every_unbuildable_choice(p, k):
    model = text_model()
    checked = check_predictions(model, rank(model, p, 16, MACHINE, model_parallel=k))
    for pred in checked:
        if pred.feasible and pred.strategy not in ("serial", "p", "ls"):
            kk = 1 if pred.strategy == "d" else k
            assert refusal(model, pred.strategy, p, kk, **(
                {"mp": pred.options["mp"]} if pred.strategy == "gmp" else {})) is None
    marked = [r for r in checked if r.reasons and r.reasons[0].startswith("transform: ")]
    assert all(not r.feasible for r in marked)
    assert [r.feasible for r in checked] == sorted((r.feasible for r in checked), reverse=True)


def test_a_cnn_keeps_its_strategies():
    model = cnn()
    before = rank(model, 4, 16, MACHINE, model_parallel=2)
    after = check_predictions(model, before)
    assert {r.strategy for r in after if r.feasible} == {r.strategy for r in before
                                                         if r.feasible}


def test_plan_text_shows_transforms_refusal():
    from tfhybrid.cli import plan_text
    text = plan_text(text_model(), p=4, batch=16, machine=MACHINE, strategies=("d", "s", "ds"))
    lines = {line.split()[1]: line for line in text.splitlines()
             if line.strip()[:1].isdigit()}
    assert " yes " in lines["d"]
    assert " NO " in lines["s"] and "transform: Strategy 's' would split no layer" in lines["s"]


def test_plan_text_lists_the_per_layer_plan_of_every_grid_with_transforms_verdict():
    from tfhybrid.cli import plan_text
    free = {"alpha": 0.0, "beta": 0.0, "flop_rate": 1e6}   # every grid splits something
    text = plan_text(cnn(), p=4, batch=16, machine=free)
    section = text.split("per layer (Gholami Eq. 6")[1].splitlines()[1:]
    assert {line.split()[1] for line in section} == {"4x1", "2x2", "1x4"}
    assert all(line.rstrip().endswith("builds") or "transform refuses" in line
               for line in section)

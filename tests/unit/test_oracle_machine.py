"""Machine validation, JSON round trip, calibration fits, report rendering."""
import json
import math

import pytest

from tfhybrid.oracle import Machine, Prediction, as_machine, default_machine_path
from tfhybrid.oracle.calibration import fit as cal
from tfhybrid.oracle import report

BASE = {"alpha": 1e-5, "beta": 1e-9, "flop_rate": 1e10}


@pytest.mark.parametrize("spec,match", [
    ({"beta": 1e-9, "flop_rate": 1.0}, r"lacks required keys \['alpha'\]"),
    ({**BASE, "speed": 1}, r"Unknown machine keys \['speed'\]"),
    ({**BASE, "alpha": -1.0}, "`alpha`=-1.0"),
    ({**BASE, "phi": 0}, "`phi`=0; expected a positive"),
    ({"alpha": 0, "beta": 0}, "needs `flop_rate`"),
    ({**BASE, "tiers": [{"max_ranks": 0, "alpha": 0, "beta": 0}]}, "`max_ranks`=0"),
    ({**BASE, "tiers": [{"alpha": 0}]}, "invalid tier"),
    ({**BASE, "layer_times": {"c": [1.0]}}, r"layer_times\['c'\]"),
    ({**BASE, "gamma": float("nan")}, "`gamma`=nan"),
])
def test_machine_validation(spec, match):
    with pytest.raises(ValueError, match=match):
        Machine.from_dict(spec)


def test_machine_type_and_missing_file_errors(tmp_path):
    with pytest.raises(TypeError, match="received list"):
        Machine.from_dict([1])
    with pytest.raises(ValueError, match="does not exist"):
        as_machine(str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="`machine` is required"):
        as_machine(None)


def test_json_round_trip(tmp_path):
    m = Machine.from_dict({**BASE, "tiers": [{"max_ranks": 4, "alpha": 1e-6, "beta": 1e-10}],
                           "layer_times": {"c": [1e-3, 2e-3]}, "memory_bytes": 8e9,
                           "compute_slots": 2})
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m.to_dict()))
    assert as_machine(str(path)) == m
    assert m.oversubscription(4) == 2.0 and m.replace(ranks_per_node=2).oversubscription(4) == 1


def test_default_machine_file_is_valid():
    m = as_machine(default_machine_path())
    assert m.flop_rate > 0 and m.tiers and "calibrate" in m.source


def test_fit_alpha_beta_recovers_parameters():
    alpha, beta = 2e-4, 3e-9
    samples = []
    for kind in cal.COLLECTIVE_KINDS:
        for p in (2, 4):
            for m in (1e3, 1e5, 1e6):
                ca, cb = cal.design_row(kind, p, m)
                samples.append((kind, p, m, ca * alpha + cb * beta))
    a, b, r2 = cal.fit_alpha_beta(samples)
    assert (a, b, r2) == (pytest.approx(alpha), pytest.approx(beta), pytest.approx(1.0))
    tiers = cal.fit_tiers(samples)
    assert [t.max_ranks for t in tiers] == [2, 4]
    assert tiers[1].beta == pytest.approx(beta)


def test_fit_collective_costs_recovers_latency_alpha_beta():
    lat, alpha, beta = 1.5e-3, 2e-4, 3e-9
    samples = []
    for kind in cal.COLLECTIVE_KINDS:
        for m in (4e3, 1e5, 2e6):
            ca, cb = cal.design_row(kind, 4, m)
            samples.append((kind, 4, m, lat + ca * alpha + cb * beta))
    got = cal.fit_collective_costs(samples)
    assert got == (pytest.approx(lat), pytest.approx(alpha), pytest.approx(beta),
                   pytest.approx(1.0))
    tier = cal.fit_tiers(samples)[0]
    assert (tier.max_ranks, tier.latency) == (4, pytest.approx(lat))
    with pytest.raises(ValueError, match="at least 3 timing samples"):
        cal.fit_collective_costs(samples[:2])


def test_latency_is_paid_once_per_collective():
    m = Machine.from_dict({**BASE, "latency": 1e-3,
                           "tiers": [{"max_ranks": 2, "alpha": 0, "beta": 0, "latency": 2e-3}]})
    assert m.t_allreduce(2, 1e6) == pytest.approx(2e-3)
    assert m.t_allgather(4, 0) == pytest.approx(1e-3 + 3 * 1e-5)
    assert m.t_p2p(0, span=2) == pytest.approx(2e-3)
    assert m.t_allreduce(1, 1e6) == 0.0 and Machine.from_dict(m.to_dict()) == m


def test_tier_by_span_only_across_nodes():
    tiers = [{"max_ranks": 2, "alpha": 1.0, "beta": 0}, {"max_ranks": 8, "alpha": 5.0, "beta": 0}]
    m = Machine.from_dict({**BASE, "tiers": tiers, "ranks_per_node": 4})
    # a 2-rank group of stride 2 (span 4) stays inside a 4-rank node: the 2-rank tier
    assert m.t_allgather(2, 0, span=4) == 1.0
    # span 8 crosses nodes: the wider tier
    assert m.t_allgather(2, 0, span=8) == 5.0
    assert m.replace(ranks_per_node=None).t_allgather(2, 0, span=4) == 5.0


def test_fit_is_non_negative_and_validates():
    # decreasing time with size would need beta < 0: clamp to beta = 0
    samples = [("allgather", 2, 1e3, 2e-3), ("allgather", 2, 1e6, 1e-3)]
    a, b, _ = cal.fit_alpha_beta(samples)
    assert a > 0 and b == 0.0
    with pytest.raises(ValueError, match="at least 2 timing samples"):
        cal.fit_alpha_beta(samples[:1])
    with pytest.raises(ValueError, match="kind='bcast'"):
        cal.design_row("bcast", 2, 1)
    assert cal.estimate_gamma(50, 100) == 0.5
    with pytest.raises(ValueError, match="naive_bytes=0"):
        cal.estimate_gamma(1, 0)
    assert cal.compute_slots() >= 1


def _pred(name, feasible=True, total=1.0):
    return Prediction(name, 2, 8, total, {"GE-allreduce": 0.5}, 0.0, 2e9,
                      {"grid": {"data": 1, "model": 2}}, feasible,
                      () if feasible else ("p=2 exceeds the batch B=1 (limit p <= B)",))


def test_report_table_json_png(tmp_path):
    preds = [_pred("df"), _pred("f", feasible=False),
             Prediction("p", 9, 8, math.inf, {}, 0.0, 0, {}, False, ("p=9 exceeds G",))]
    text = report.format_table(preds)
    assert "df" in text and "NO" in text and "p=2 exceeds the batch" in text
    assert " 1500 " in text and "ms per iteration" in text   # total 1.5 s in ms
    doc = report.to_json(preds, {"model": "m"}, dataset_size=80)
    assert doc["predictions"][2]["compute_s"] is None
    assert doc["predictions"][0]["per_epoch"]["iterations"] == 10
    json.dumps(doc)
    png = tmp_path / "chart.png"
    report.plot_png(str(png), preds, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fit_line_intercept_and_slope_non_negative():
    assert cal.fit_line([16, 64], [0.004, 0.010]) == pytest.approx((0.002, 0.000125))
    assert cal.fit_line([16, 64], [0.010, 0.004]) == pytest.approx((0.007, 0.0))  # no slope < 0
    assert cal.fit_line([8, 8], [1.0, 3.0]) == (0.0, 0.25)   # one batch size: through 0
    with pytest.raises(ValueError, match="as many x as y"):
        cal.fit_line([1, 2], [1.0])
    m = Machine.from_dict({"alpha": 0, "beta": 0, "flop_rate": 1.0, "compute_fixed_s": 0.5})
    assert m.compute_fixed_s == 0.5 and Machine.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="compute_fixed_s"):
        Machine.from_dict({"alpha": 0, "beta": 0, "flop_rate": 1.0, "compute_fixed_s": -1})


def test_gamma_not_measurable_when_peak_rss_already_higher(monkeypatch):
    """A process that already peaked higher (an earlier model) cannot measure gamma:
    it stays 1 instead of 0, which Machine would reject."""
    import keras
    from tfhybrid.oracle.calibration import run
    monkeypatch.setattr(run, "_rss_bytes", lambda: 5_000_000)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    gamma, grown = run.measure_gamma(model, 2, naive_bytes=1000.0, steps=1)
    assert (gamma, grown) == (1.0, 0.0)
    from tfhybrid.oracle import Machine
    Machine(alpha=0.0, beta=0.0, flop_rate=1.0, gamma=gamma)


def test_overlap_credit_hides_part_of_the_gradient_allreduce():
    """A measured overlap subtracts overlap x min(GE-allreduce, backward compute) from
    the total; 0 keeps the papers' no-overlap sum; beyond [0, 1] is refused."""
    from tfhybrid.oracle import predict
    import keras
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    base = {"alpha": 1e-4, "beta": 1e-8, "flop_rate": 1e9}
    none = predict(model, "d", 2, 16, base)
    half = predict(model, "d", 2, 16, dict(base, overlap=0.5))
    ge = none.comm_s["GE-allreduce"]
    assert none.hidden_s == 0.0 and ge > 0
    assert 0 < half.hidden_s <= 0.5 * ge + 1e-15
    assert half.total_s == pytest.approx(none.total_s - half.hidden_s)
    with pytest.raises(ValueError, match=r"`overlap`=1.5; expected a fraction"):
        Machine(alpha=0.0, beta=0.0, flop_rate=1.0, overlap=1.5)


def test_batch_norm_moments_are_priced_where_they_are_synchronized():
    """SyncBatchNormalization's 4 allreduces (C+1, C items, forward and backward) per
    BatchNormalization over the batch-splitting ranks: d over p, f none."""
    import keras
    from tfhybrid.oracle import predict
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3),
                              keras.layers.BatchNormalization(), keras.layers.Flatten(),
                              keras.layers.Dense(8)])
    mach = Machine(alpha=1e-3, beta=0.0, flop_rate=1e9)
    d = predict(model, "d", 4, 16, mach)
    assert d.comm_s["FB-allreduce"] == pytest.approx(4 * mach.t_allreduce(4, 36))
    assert predict(model, "f", 4, 16, mach).comm_s["FB-allreduce"] == pytest.approx(
        predict(keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(8)]),
                "f", 4, 16, mach).comm_s["FB-allreduce"])


def test_calibration_names_each_collective_size_apart():
    """Calibration's collectives carry one name per kind, group size and message
    size, as a training step's collectives do, so Horovod's response cache serves
    their repeats (one name for all sizes made every call a cache miss: 2-3x the
    cost per 2-rank collective at 4 ranks)."""
    from tfhybrid.oracle.calibration import fit

    names = []

    class Recording:
        def allreduce(self, x, ranks, name):
            names.append(name)
            return x

        def allgather(self, x, ranks, name):
            names.append(name)
            return x

        def alltoall(self, x, splits, ranks, name):
            names.append(name)
            return x

        def rank(self):      # p2p's receiver: its result is what it received
            return 1

    for kind in fit.COLLECTIVE_KINDS:
        for ranks in ((0, 1), (0, 1, 2, 3)):
            for n in (8, 16):
                fit._collective(kind, list(range(n)), ranks, Recording(), n)
    assert len(set(names)) == len(names) == 4 * len(fit.COLLECTIVE_KINDS) == 16


def _time_collectives_as(monkeypatch, rank, size, sizes, groups, local=None):
    """Run calibration's collective timing as ``rank`` of ``size`` (``local`` per node,
    default all) on a recording backend: (syncs, chains run in order)."""
    from tfhybrid.comm import backend
    from tfhybrid.oracle.calibration import fit

    syncs, chains = [], []

    def allreduce(x, ranks, name):
        syncs.append(name)
        return x
    monkeypatch.setattr(backend, "size", lambda: size)
    monkeypatch.setattr(backend, "rank", lambda: rank)
    monkeypatch.setattr(backend, "local_size", lambda: size if local is None else local)
    monkeypatch.setattr(backend, "register_groups", lambda groups: None)
    monkeypatch.setattr(backend, "allreduce", allreduce)

    def chain(kind, ranks, backend_, length, n):
        def run(x):
            chains.append((kind, len(ranks), n, length))
            return x
        return run
    monkeypatch.setattr(fit, "collective_chain", chain)
    fit.time_collectives(sizes, groups, reps=2, log=lambda *_: None)
    return syncs, chains


def test_calibration_times_one_size_after_the_other_on_every_rank(monkeypatch):
    """The kinds of a size interleave, sizes go from the smallest (a small
    collective right after a 4 MB one took 1.5-3x its time), and a rank outside
    every group of a size (6 ranks, groups of 4) joins the same syncs as the
    others, without which the world's syncs pair up wrongly and the job hangs."""
    from tfhybrid.oracle.calibration import fit

    sizes = [4096, 65536]
    syncs0, chains0 = _time_collectives_as(monkeypatch, 0, 6, sizes, [2, 4, 6])
    syncs5, chains5 = _time_collectives_as(monkeypatch, 5, 6, sizes, [2, 4, 6])
    assert syncs0 and syncs0 == syncs5
    assert not any(g == 4 for _, g, _, _ in chains5) and any(g == 4 for _, g, _, _ in chains0)
    timed = [c for c in chains0 if c[1] == 2]
    # warm-up + the repetitions of each kind (2, more for small messages)
    per_size = len(fit.COLLECTIVE_KINDS) * (1 + fit.repetitions(4096, 2))
    firsts = timed[:per_size]
    assert {n for _, _, n, _ in firsts} == {1024} and \
        {k for k, _, _, _ in firsts} == set(fit.COLLECTIVE_KINDS)
    assert {n for _, _, n, _ in timed[per_size:]} == {16384}
    assert {length for *_, length in chains0} == {4}     # inside one node: chains of 4


def test_calibration_across_nodes_times_one_collective_at_a_time(monkeypatch):
    """Across nodes (one rank per node): one collective per timing (p2p: there and
    back, so the time counts delivery), and the seconds per collective follow."""
    from tfhybrid.oracle.calibration import fit

    _, chains = _time_collectives_as(monkeypatch, 0, 2, [4096], [2], local=1)
    assert {(k, length) for k, _, _, length in chains} == {
        (k, 2 if k == "p2p" else 1) for k in fit.COLLECTIVE_KINDS}
    monkeypatch.setattr(fit, "times_interleaved",
                        lambda calls, reps, before=None, stat="best": [0.5] * len(calls))
    samples = fit.time_collectives([4096], [2], reps=2, log=lambda *_: None)
    assert {k: sec for k, _, _, sec in samples} == {
        k: (0.25 if k == "p2p" else 0.5) for k in fit.COLLECTIVE_KINDS}


# -- collective kinds ------------------------------------------------------------------

def _kinds_machine(**extra):
    tier = {"max_ranks": 2, "alpha": 0.0, "beta": 1e-9, "latency": 1e-3,
            "collectives": {"allgather": {"latency": 2e-3, "alpha": 0.0, "beta": 3e-9},
                            "alltoall": {"latency": 4e-3, "alpha": 0.0, "beta": 5e-9}}}
    return Machine.from_dict({"alpha": 1e-6, "beta": 2e-9, "flop_rate": 1e9,
                              "tiers": [tier], **extra})


def test_each_collective_kind_pays_its_own_calibrated_cost():
    m = _kinds_machine()
    assert m.t_allgather(2, 1e6) == pytest.approx(2e-3 + 1e6 * 3e-9)
    assert m.t_alltoall(2, 1e6) == pytest.approx(4e-3 + 0.5e6 * 5e-9)
    # tfhybrid's reduce-scatter, rooted reduce and halo exchange are alltoalls
    assert m.t_reducescatter(2, 1e6) == m.t_alltoall(2, 1e6)
    assert m.t_neighbours(2, 1e6) == pytest.approx(4e-3 + 1e6 * 5e-9)
    assert m.t_reduce(2, 1e6) == pytest.approx(4e-3 + 1e6 * 5e-9)
    # a kind the tier does not list uses the tier's own numbers
    assert m.t_allreduce(2, 1e6) == pytest.approx(1e-3 + 1e6 * 1e-9)
    assert m.t_broadcast(2, 1e6) == pytest.approx(1e-3 + 1e6 * 1e-9)
    # beyond every tier: the machine's numbers (no collectives there)
    assert m.t_allgather(4, 1e6) == pytest.approx(3 * (1e-6 + 1e6 * 2e-9))
    # a transfer one way: the alltoall's cost until a p2p kind is calibrated
    assert m.t_p2p(1e6) == pytest.approx(4e-3 + 1e6 * 5e-9)
    assert m.t_neighbours(2, 1e6, kind="p2p") == m.t_p2p(1e6)


def test_a_calibrated_p2p_kind_prices_the_transfers_one_way():
    m = _kinds_machine()
    tier = m.to_dict()["tiers"][0]
    tier["collectives"]["p2p"] = {"latency": 1e-3, "alpha": 0.0, "beta": 3.5e-9}
    m = Machine.from_dict(dict(m.to_dict(), tiers=[tier]))
    assert m.t_p2p(1e6) == pytest.approx(1e-3 + 1e6 * 3.5e-9)
    assert m.t_neighbours(2, 1e6) == pytest.approx(4e-3 + 1e6 * 5e-9)    # halos: alltoall
    # calibration fits it from one-way timings: latency + m beta
    rows = [("p2p", 2, nb, 1e-3 + nb * 3.5e-9) for nb in (1e4, 1e5, 1e6)]
    assert cal.fit_kind_costs(rows)["p2p"]["beta"] == pytest.approx(3.5e-9)


def test_a_links_burst_is_fitted_and_streamed_p2p_pays_it_all(tmp_path):
    """A link that lets a burst through carries the first bytes of a lone
    collective free: calibration fits the burst beside latency and beta, small
    collectives pay the fixed cost only, and a pipeline's transfers, which
    follow one another, pay every byte and the smallest message's time less
    its bytes as fixed cost."""
    beta, burst = 8e-8, 30_000
    sizes = (4096, 11024, 29672, 79888, 215040, 578856, 1558176, 4194304)
    rows = [("p2p", 2, nb, 1e-3 + beta * max(nb - burst, 0)) for nb in sizes]
    cost = cal.fit_kind_costs(rows)["p2p"]
    assert cost["burst_bytes"] == 29672                  # the largest size timed below it
    assert cost["latency"] == pytest.approx(1e-3, rel=0.05)
    assert cost["beta"] == pytest.approx(beta, rel=0.01)
    assert cost["stream_latency"] == pytest.approx(1e-3 - 4096 * cost["beta"])
    m = _kinds_machine()
    tier = m.to_dict()["tiers"][0]
    tier["collectives"]["p2p"] = cost
    m = Machine.from_dict(dict(m.to_dict(), tiers=[tier]))
    assert m.t_p2p(16384) == pytest.approx(cost["latency"])          # within the burst
    assert m.t_p2p(1e6) == pytest.approx(cost["latency"] + (1e6 - 29672) * cost["beta"])
    assert m.t_p2p(16384, streamed=True) == pytest.approx(
        cost["stream_latency"] + 16384 * cost["beta"])
    assert m.t_neighbours(2, 16384, kind="p2p") == m.t_p2p(16384)     # ls: one at a time
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m.to_dict()))
    assert Machine.load(path) == m
    # without a burst the fit is the line, and the smallest message pays its bytes
    rows = [("p2p", 2, nb, 1e-3 + beta * nb) for nb in sizes]
    cost = cal.fit_kind_costs(rows)["p2p"]
    assert cost["burst_bytes"] == 0.0
    assert cost["stream_latency"] == pytest.approx(cost["latency"], rel=1e-6)
    assert cost["latency"] == pytest.approx(1e-3)


def test_every_kind_pays_beta_beyond_its_burst_only():
    m = Machine(alpha=0.0, beta=1e-9, flop_rate=1.0, collectives={
        k: {"latency": 1e-3, "alpha": 0.0, "beta": 1e-8, "burst_bytes": 1e4}
        for k in ("allreduce", "allgather", "alltoall", "broadcast")})
    assert m.t_allreduce(2, 1e4) == pytest.approx(1e-3)             # sends 1e4 in all
    assert m.t_allreduce(2, 3e4) == pytest.approx(1e-3 + 2e4 * 1e-8)
    assert m.t_allgather(2, 3e4) == pytest.approx(1e-3 + 2e4 * 1e-8)
    assert m.t_alltoall(2, 6e4) == pytest.approx(1e-3 + 2e4 * 1e-8)
    assert m.t_neighbours(2, 3e4) == pytest.approx(1e-3 + 2e4 * 1e-8)
    assert m.t_broadcast(2, 3e4) == pytest.approx(1e-3 + 2e4 * 1e-8)
    with pytest.raises(ValueError, match="burst_bytes"):
        Machine(alpha=0.0, beta=1e-9, flop_rate=1.0,
                collectives={"p2p": {"latency": 0, "alpha": 0, "beta": 0, "burst": 1}})


def test_a_pipeline_of_micro_batches_pays_the_stream_latency():
    """p's transfers follow one another when there are several micro-batches: each
    pays ``stream_latency``; one micro-batch's transfers are priced as sent alone."""
    from tfhybrid.oracle import LayerRow, ModelProfile, predict
    fc1 = LayerRow("fc1", "dense", 12, 8, 4, 16, 32, 2, 4, 2, 4, ccr=1.0)
    fc2 = LayerRow("fc2", "dense", 10, 8, 2, 16, 32, 4, 2, 4, 2, ccr=1.0)
    prof = ModelProfile("two_fc", (fc1, fc2), 2)
    cost = {"latency": 1.0, "alpha": 0.0, "beta": 0.5}
    base = dict(alpha=1.0, beta=0.5, flop_rate=8.0, bytes_per_item=1, wu_flops_per_param=0.0)
    plain = Machine(**base, collectives={"p2p": cost})
    stream = Machine(**base, collectives={"p2p": dict(cost, stream_latency=3.0)})
    one = [predict(prof, "p", 2, 4, m, segments=1).total_s for m in (plain, stream)]
    assert one[0] == one[1]
    two = [predict(prof, "p", 2, 4, m, segments=2).total_s for m in (plain, stream)]
    # 4 transfers (2 micro-batches, there and back), each 2 s dearer; some overlap compute
    assert two[0] + 2.0 <= two[1] <= two[0] + 4 * 2.0


def test_calibration_times_small_messages_more_often():
    from tfhybrid.oracle.calibration import fit
    assert [fit.repetitions(n, 5) for n in (1024, 4096, 65536, 4 << 20)] == [40, 40, 5, 5]


def test_machine_level_collectives_serve_groups_beyond_the_tiers(tmp_path):
    m = _kinds_machine(collectives={"allreduce": {"latency": 0.5, "alpha": 0.0, "beta": 0.0}})
    assert m.t_allreduce(8, 1e6) == 0.5
    assert m.collective_cost("allreduce", 8) == (0.5, 0.0, 0.0)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m.to_dict()))
    assert Machine.load(path) == m


@pytest.mark.parametrize("table, match", [
    ({"gather": {"latency": 0, "alpha": 0, "beta": 0}}, r"kind 'gather'"),
    ({"allgather": {"latency": 0, "beta": 0}}, r"expected the keys"),
    ({"p2p": {"latency": 0, "alpha": 0, "beta": 0, "stream": 0}}, r"expected the keys"),
    ({"allgather": {"latency": -1, "alpha": 0, "beta": 0}}, r"allgather'\]\.latency"),
    ([1, 2], r"must map collective kinds"),
])
def test_collectives_validation(table, match):
    with pytest.raises(ValueError, match=match):
        Machine.from_dict({"alpha": 0, "beta": 0, "flop_rate": 1.0, "collectives": table})
    with pytest.raises(ValueError, match=match):
        Machine.from_dict({"alpha": 0, "beta": 0, "flop_rate": 1.0, "tiers": [
            {"max_ranks": 2, "alpha": 0, "beta": 0, "collectives": table}]})
    with pytest.raises(ValueError, match="expected one of"):
        _kinds_machine().collective_cost("gather", 2)


def test_calibration_fits_each_kind_apart():
    truth = {"allreduce": (1e-3, 1e-9), "allgather": (2e-3, 3e-9), "alltoall": (4e-3, 5e-9)}
    rows = []
    for kind, (lat, beta) in truth.items():
        for m in (4096, 65536, 1 << 20, 4 << 20):
            rows.append((kind, 2, m, lat + cal.design_row(kind, 2, m)[1] * beta))
    (tier,) = cal.fit_tiers(rows)
    for kind, (lat, beta) in truth.items():
        got = tier.collectives[kind]
        assert got["latency"] == pytest.approx(lat, rel=1e-6)
        assert got["beta"] == pytest.approx(beta, rel=1e-6)
        assert got["alpha"] == 0.0
    m = Machine(alpha=tier.alpha, beta=tier.beta, latency=tier.latency, tiers=(tier,),
                flop_rate=1.0)
    for kind, row in (("allgather", m.t_allgather), ("alltoall", m.t_alltoall)):
        lat, beta = truth[kind]
        assert row(2, 1 << 20) == pytest.approx(lat + cal.design_row(kind, 2, 1 << 20)[1] * beta)
    with pytest.raises(ValueError, match="one group size"):
        cal.fit_kind_costs(rows + [("allreduce", 4, 4096, 1.0)])
    # a kind timed at a single size is left to the common fit
    assert "alltoall" not in cal.fit_kind_costs([r for r in rows if r[0] != "alltoall"]
                                                + [("alltoall", 2, 4096, 1e-3)])


def test_weighted_fit_keeps_small_messages_priced():
    """Large messages must not set the latency alone (weights 1/sqrt(seconds))."""
    rows = [("allreduce", 2, m, 3e-3 + m * 8e-8) for m in (4096, 16384, 65536)]
    rows += [("allreduce", 2, 4 << 20, 1.2 * (3e-3 + (4 << 20) * 8e-8))]   # one slow large one
    cost = cal.fit_kind_costs(rows)["allreduce"]
    lat = cost["latency"]
    assert lat == pytest.approx(3e-3, rel=0.15)


def test_allreduce_link_reads_the_machine_file(tmp_path):
    from tfhybrid.oracle.machine import allreduce_link
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_kinds_machine(collectives={
        "allreduce": {"latency": 2e-3, "alpha": 0.0, "beta": 8e-8}}).to_dict()))
    fixed, per_byte = allreduce_link(path, 4, 4)
    assert fixed == pytest.approx(2e-3)
    assert per_byte == pytest.approx(2 * 3 / 4 * 8e-8)
    assert allreduce_link(path, 1, 1) == (0.0, 0.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="TFHYBRID_MACHINE=.*cannot read it"):
        allreduce_link(bad, 2, 2)


def test_interleaved_timings_keep_the_best_the_median_or_the_trimmed_mean(monkeypatch):
    # each call of fn takes the next of these durations (perf_counter advances by them)
    durations = iter([0.0, 3.0, 1.0, 2.0])     # a warm-up call, then 3 repetitions
    clock = [0.0]

    def fn():
        clock[0] += next(durations)
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    assert cal.times_interleaved([fn], 3) == [1.0]
    durations = iter([0.0, 3.0, 1.0, 2.0])
    assert cal.times_interleaved([fn], 3, stat="median") == [2.0]
    # two groups of times (a cycle caught or missed) and one outlier: the mean of the
    # middle three of five, where the median would land in one group
    durations = iter([0.0, 1.0, 5.0, 1.0, 40.0, 5.0])
    assert cal.times_interleaved([fn], 5, stat="mean") == [pytest.approx(11 / 3)]
    durations = iter([0.0, 1.0, 5.0, 1.0, 40.0, 5.0])
    assert cal.times_interleaved([fn], 5, stat="median") == [5.0]
    assert cal.trimmed_mean([2.0]) == 2.0
    with pytest.raises(ValueError, match="stat='worst'"):
        cal.times_interleaved([fn], 3, stat="worst")
    with pytest.raises(ValueError, match="no times"):
        cal.trimmed_mean([])


def test_fit_burst_keeps_a_plain_line_where_no_burst_fits_better():
    """Noise of a few percent on a line must not invent a burst (a burst is only
    taken where it fits 1% better), and one size cannot be fitted."""
    sizes = [4e3, 1e4, 3e4, 8e4, 2e5, 6e5, 1.6e6, 4e6]
    noise = [1.02, 0.98, 1.01, 0.99, 1.02, 0.99, 1.01, 1.0]
    t = [(1e-3 + 8e-8 * n) * f for n, f in zip(sizes, noise)]
    lat, beta, burst = cal.fit_burst(sizes, t)
    assert burst == 0.0
    assert lat == pytest.approx(1e-3, rel=0.1) and beta == pytest.approx(8e-8, rel=0.02)
    with pytest.raises(ValueError, match="at least two sizes"):
        cal.fit_burst([4e3, 4e3], [1e-3, 1e-3])

"""Strategy models on a hand-made two-layer profile, computed by hand; feasibility
reasons; choose/rank; argument validation."""
import dataclasses

import pytest

from tfhybrid.oracle import (LayerRow, Machine, ModelProfile, Prediction, choose, predict,
                             rank)

FC1 = LayerRow("fc1", "dense", 12, 8, 4, 16, 32, 2, 4, 2, 4, ccr=1.0)
FC2 = LayerRow("fc2", "dense", 10, 8, 2, 16, 32, 4, 2, 4, 2, ccr=1.0)
PROF = ModelProfile("two_fc", (FC1, FC2), 2)
# delta = 1 byte, fb = 48 FLOPs / 8 FLOP/s = 6 s per sample and layer, no weight update cost
M = Machine(alpha=1.0, beta=0.5, flop_rate=8.0, bytes_per_item=1, wu_flops_per_param=0.0)
CONV = LayerRow("c1", "conv", 20, 18, 2, 64, 128, 64, 128, 1, 2, (8, 8), (8, 8), (3, 3), (1, 1))
CPROF = ModelProfile("conv", (CONV,), 64)


def test_serial_hand():
    r = predict(PROF, "serial", 1, 4, M)
    assert (r.compute_s, r.comm_total_s, r.memory_bytes) == (48.0, 0.0, 134.0)
    assert r.feasible and r.options == {"p": 1}


def test_data_hand():
    r = predict(PROF, "d", 2, 4, M)
    assert r.compute_s == 24.0
    assert r.comm_s["GE-allreduce"] == pytest.approx(2 * (1 + 22 / 2 * 0.5))
    assert r.memory_bytes == 86.0 and r.total_s == pytest.approx(37.0)


def test_filter_pairing_hand():
    r = predict(PROF, "f", 2, 4, M)
    assert r.options["pairs"] == [("fc1", "fc2")]
    assert r.compute_s == 24.0 and r.comm_s["FB-allgather"] == 0.0
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 8 / 2 * 0.5))  # y of fc2 only


def test_filter_hand():
    r = predict(PROF, "f", 2, 4, M, pairing=False)
    assert r.compute_s == 24.0
    assert r.comm_s["FB-allgather"] == pytest.approx(1 + 8 * 0.5)     # y of fc1, not of fc2
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 8 * 0.5))  # dL/dx of fc2 only
    assert r.comm_s["GE-allreduce"] == 0.0 and r.memory_bytes == 118.0


def test_channel_hand_skips_first_layer():
    r = predict(PROF, "c", 2, 4, M)
    assert r.options["partitioned_layers"] == ["fc2"]
    assert r.compute_s == pytest.approx(24 + 12)
    assert r.comm_s["FB-allgather"] == pytest.approx(1 + 8 * 0.5)
    # the model's output is partial and must be reduced for the loss (tfhybrid)
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 8 / 2 * 0.5))


def test_data_filter_hand():
    r = predict(PROF, "df", 4, 4, M, grid=(2, 2), pairing=False)
    assert r.compute_s == pytest.approx(12.0)
    assert r.comm_s["FB-allgather"] == pytest.approx(1 + 4 * 0.5)
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 4 * 0.5))
    assert r.comm_s["GE-allreduce"] == pytest.approx(2 * (1 + 11 / 2 * 0.5))
    assert r.options["grid"] == {"data": 2, "model": 2}
    assert "gholami_eq5_comm_s" in r.options


def test_data_filter_phi_scales_only_data_allreduce():
    r1 = predict(PROF, "df", 4, 4, M, grid=(2, 2), pairing=False)
    r2 = predict(PROF, "df", 4, 4, M.replace(phi=2.0), grid=(2, 2), pairing=False)
    assert r2.comm_s["GE-allreduce"] == pytest.approx(2 * (1 + 11 / 2 * 0.5 * 2))
    assert r2.comm_s["FB-allgather"] == r1.comm_s["FB-allgather"]


def test_pipeline_hand():
    r = predict(PROF, "p", 2, 4, M, segments=2)
    # fill-drain, per micro-batch of 2 rows F = 4 s and B = 8 s per stage: F F | F F, then
    # B B | B B on stage 1 and stage 0: (S + M - 1)(F + B) = 36 s, as Eq. 12
    assert r.compute_s == pytest.approx(4 / 2 * 3 * (2 + 4))
    # each transfer (alpha + 2 x 4 items x beta = 5 s) runs while the sender computes its
    # next micro-batch, but after the pair's earlier transfer (one collective at a time
    # per rank): 4-9, then 9-14 (issued at 8); stage 1 computes F 9-13, 14-18, B 18-26,
    # 26-34; the errors travel 26-31 and 34-39; stage 0's B 31-39, 39-47; the
    # predictions' broadcast (5 s) follows the last transfer (39 -> 44): 47 s, 11 s
    # beyond the compute; ParaDL's Eq. 13 serialises all 2 (p + S - 2) transfers and
    # the broadcast: 25 s
    assert r.comm_s["p2p"] == pytest.approx(11.0)
    assert r.total_s == pytest.approx(47.0)
    assert r.memory_bytes == 68.0 and r.options["segments"] == 2


def test_gmp_hand():
    r = predict(PROF, "gmp", 2, 4, M, mp=2, scheme="B/K", ccr_threshold=0)
    assert r.options["partitioned_layers"] == ["fc1", "fc2"]
    assert r.options["pairs"] == [("fc1", "fc2")]
    assert r.compute_s == pytest.approx(24.0)
    # B/K: 2 micro-steps of 1 sample per rank: modulo (x=2) and its adjoint, the pair's
    # allreduce of y_fc2 for 2 samples; leaving the region is a slice forward and,
    # after the pair's channel layer, an allgather of y_fc2's gradient (1 sample, y=2)
    assert r.comm_s["FB-allgather"] == pytest.approx(4 * (1 + 1) + 2 * (1 + 2 * 0.5))
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * 2 * (1 + 4 / 2 * 0.5))
    assert r.comm_s["GE-allreduce"] == 0.0
    assert r.options["param_memory_bytes"] == pytest.approx(22 / 2)


def test_gmp_bk_scheme_default():
    r = predict(PROF, "gmp", 2, 4, M, mp=2, ccr_threshold=0)
    assert r.options["scheme"] == "BK"
    # one step of 2 samples per rank: modulo (x=2) + adjoint, pair allreduce of y_fc2 for 4,
    # the exit's backward allgather of y_fc2's gradient (2 samples, y=2)
    assert r.comm_s["FB-allgather"] == pytest.approx(2 * (1 + 2 * 2 * 0.5) + (1 + 2 * 2 * 0.5))
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 8 / 2 * 0.5))


def test_gmp_exit_after_a_shard_moves_nothing():
    # fc1 alone partitioned (fc2's CCR below the threshold): fc2 replicated, so the
    # exit all-gathers its gradient; fc2 partitioned and unpaired (a shard): nothing
    shard = ModelProfile("fc_shard", (FC1, dataclasses.replace(FC2, channels=3)), 2)
    r = predict(shard, "gmp", 2, 4, M, mp=2, ccr_threshold=0)
    assert r.options["pairs"] == []
    # modulo (x=2) + adjoint, shards of y_fc1 (2 samples, y=4) and y_fc2 (y=2), no exit
    assert r.comm_s["FB-allgather"] == pytest.approx(
        2 * (1 + 2 * 2 * 0.5) + (1 + 2 * 4 * 0.5) + (1 + 2 * 2 * 0.5))


def test_filter_fallback_replicates_what_the_group_cannot_split():
    # fc2 has 2 filters: a group of 4 cannot split it; transform(fallback="replicate")
    # replicates it, so fc1 is an unpaired filter layer: allgather y, allreduce x
    strict = predict(PROF, "f", 4, 4, M)
    assert not strict.feasible
    r = predict(PROF, "f", 4, 4, M, fallback="replicate")
    assert r.feasible and r.options["replicated_layers"] == ["fc2"]
    assert r.options["pairs"] == [] and r.options["partitioned_layers"] == ["fc1"]
    assert r.comm_s["FB-allgather"] == pytest.approx(3 * (1 + 4 * 4 / 4 * 0.5))
    assert r.comm_s["FB-allreduce"] == 0.0      # fc1 is the first layer: no dL/dx
    with pytest.raises(ValueError, match="fallback='maybe'"):
        predict(PROF, "f", 4, 4, M, fallback="maybe")


def test_gmp_ccr_threshold_keeps_layers_replicated():
    r = predict(PROF, "gmp", 2, 4, M, mp=2, ccr_threshold=5.0)
    assert r.options["partitioned_layers"] == []
    assert r.options["replicated_layers"][0][0] == "fc1"


def test_layer_separation_hand():
    r = predict(PROF, "ls", 2, 4, M)
    assert (r.options["n_c"], r.options["n_f"]) == (1, 1)
    assert r.compute_s == pytest.approx(48.0)
    assert r.comm_s["p2p"] == pytest.approx(2 * 1 + 2 * 4 * 2 * 0.5)
    assert "ps_baseline_s" in r.options


def test_spatial_hand():
    r = predict(CPROF, "s", 2, 4, M, spatial=(2, 1))
    assert r.compute_s == pytest.approx(4 * 24 * 0.5)
    # the first layer (the model input's) exchanges forward only: one alltoall over 2
    # ranks, each sending h_x to its one neighbour: (p-1) alpha + h_x beta
    assert r.comm_s["halo"] == pytest.approx(1 + 4 * 0.5 * 8)
    two = ModelProfile("conv2", (CONV, dataclasses.replace(CONV, name="c2")), 64)
    r2 = predict(two, "s", 2, 4, M.replace(latency=0.25), spatial=(2, 1))
    # + the second layer's forward and backward (h_dy = 16), 0.25 latency per exchange
    assert r2.comm_s["halo"] == pytest.approx(
        3 * 0.25 + (1 + 4 * 0.5 * 8) * 2 + (1 + 4 * 0.5 * 16))
    # 4 blocks along H: the inner ranks send a face to both neighbours, 3 alphas
    r4 = predict(CPROF, "s", 4, 4, M, spatial=(4, 1))
    assert r4.comm_s["halo"] == pytest.approx(3 * 1 + 4 * 0.5 * 2 * 8)
    assert r.comm_s["GE-allreduce"] == pytest.approx(2 * (1 + 10 * 0.5))
    assert r.options["grid"] == {"data": 1, "spatial": [2, 1]}


def test_spatial_region_ending_in_global_average_all_reduces_the_block_sums():
    """A GlobalAveragePooling after the region pools the blocks: one all-reduce of
    batch x (channels + 1) numbers instead of all-gathering the feature map."""
    gap = LayerRow("gap", "pool", 0, 0, 0, 128, 128, 128, 2, 2, 2, (8, 8), (),
                   global_pool="average")
    fc = LayerRow("fc", "dense", 6, 4, 2, 8, 16, 2, 2, 2, 2, ccr=1.0)
    pooled = predict(ModelProfile("gap", (CONV, gap, fc), 64), "s", 2, 4, M, spatial=(2, 1))
    # 2(p-1)(alpha + m/p beta), m = 4 rows x 3 numbers
    assert pooled.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 4 * 3 / 2 * 0.5))
    assert pooled.comm_s.get("FB-allgather", 0.0) == 0.0
    maxima = predict(ModelProfile("gmp", (CONV, dataclasses.replace(gap, global_pool="max"),
                                          fc), 64), "s", 2, 4, M, spatial=(2, 1))
    # the maxima gathered, (p-1)(alpha + m beta), m = 4 x 2; the tie counts all-reduced
    assert maxima.comm_s["FB-allgather"] == pytest.approx(1 + 4 * 2 * 0.5)
    assert maxima.comm_s["FB-allreduce"] == pytest.approx(2 * (1 + 4 * 2 / 2 * 0.5))
    plain = dataclasses.replace(gap, global_pool="")     # e.g. channels first: gathered
    gathered = predict(ModelProfile("plain", (CONV, plain, fc), 64), "s", 2, 4, M,
                       spatial=(2, 1))
    # (p-1)(alpha + m beta), m = 4 rows x the block's half of the 128 items
    assert gathered.comm_s["FB-allgather"] == pytest.approx(1 + 4 * 64 * 0.5)
    assert pooled.compute_s < gathered.compute_s       # the pooling runs on the blocks


def test_data_spatial_grid():
    r = predict(CPROF, "ds", 4, 4, M, spatial=(2, 1))
    assert r.compute_s == pytest.approx(2 * 24 * 0.5)
    assert r.comm_s["halo"] == pytest.approx(1 + 2 * 0.5 * 8)


def test_spatial_gradients_world_for_spatial_layers_data_groups_for_the_rest():
    prof = ModelProfile("conv_fc", (CONV, FC2), 64)
    r = predict(prof, "ds", 4, 4, M, spatial=(2, 1))
    # conv (20 params, partial sums) over all 4 ranks; fc2 (10) over the 2 data replicas
    assert r.comm_s["GE-allreduce"] == pytest.approx(6 * (1 + 20 / 4 * 0.5) + 2 * (1 + 10 / 2 * 0.5))


@pytest.mark.parametrize("strategy,p,batch,opts,match", [
    ("d", 8, 4, {}, "p=8 exceeds the batch B=4"),
    ("d", 3, 4, {}, "batch B=4 is not divisible by p=3"),
    ("f", 8, 4, {}, "exceeds the minimum filters 2 of layer 'fc2'"),
    ("c", 3, 6, {}, r"channels of layers \['fc2'\] not divisible by model group 3"),
    ("c", 8, 8, {}, "exceeds the minimum channels 4"),
    ("p", 3, 4, {}, "p=3 exceeds the number of layers G=2"),
    ("ls", 1, 4, {}, "needs p >= 2"),
    ("df", 3, 6, {}, "no factorisation"),
])
def test_infeasible_reasons(strategy, p, batch, opts, match):
    r = predict(PROF, strategy, p, batch, M, **opts)
    assert not r.feasible
    assert any(pytest.importorskip("re").search(match, x) for x in r.reasons), r.reasons


def test_spatial_limit_reason_not_clipped():
    r = predict(CPROF, "s", 16, 4, M, spatial=(16, 1))
    assert not r.feasible and "exceeds the extent 8 of layer 'c1'" in r.reasons[0]
    assert r.compute_s > 0   # still predicted, flagged, not clipped


def test_memory_capacity_reason():
    r = predict(PROF, "serial", 1, 4, M.replace(memory_bytes=100.0))
    assert not r.feasible and "exceeds the machine's memory_bytes" in r.reasons[0]


def test_rank_and_choose():
    ranked = rank(PROF, 2, 4, M)
    assert [r.feasible for r in ranked] == sorted((r.feasible for r in ranked), reverse=True)
    totals = [r.total_s for r in ranked if r.feasible]
    assert totals == sorted(totals)
    best = choose(PROF, 2, 4, M)
    assert best.feasible and best.strategy != "serial" and best.total_s == totals[0] or \
        best.total_s <= totals[0]


def test_choose_with_grid_restricts_model_parallel():
    class Grid:
        size, model_size = 4, 2
    best = choose(PROF, batch_size=4, machine=M, grid=Grid())
    assert best.strategy in ("df", "ds", "gmp")
    if best.strategy == "df":
        assert best.options["grid"] == {"data": 2, "model": 2}


def test_choose_errors():
    with pytest.raises(ValueError, match="needs p \\(or grid\\), batch_size and machine"):
        choose(PROF, 2)
    with pytest.raises(ValueError, match="No feasible strategy for p=8, batch_size=4"):
        choose(PROF, 8, 4, M, strategies=("d", "f"))


def test_predict_argument_errors():
    with pytest.raises(ValueError, match="strategy='x'"):
        predict(PROF, "x", 2, 4, M)
    with pytest.raises(ValueError, match="p=0"):
        predict(PROF, "d", 0, 4, M)
    with pytest.raises(ValueError, match="Unknown options \\['mp'\\] for strategy 'd'"):
        predict(PROF, "d", 2, 4, M, mp=2)
    with pytest.raises(ValueError, match="scheme='X'"):
        predict(PROF, "gmp", 2, 4, M, scheme="X")
    with pytest.raises(ValueError, match="n_f=5"):
        predict(PROF, "ls", 2, 4, M, n_f=5)


def test_prediction_per_epoch_and_validation():
    r = predict(PROF, "d", 2, 4, M)
    ep = r.per_epoch(40)
    assert ep["iterations"] == 10 and ep["total_s"] == pytest.approx(10 * r.total_s)
    with pytest.raises(ValueError, match="dataset_size=0"):
        r.per_epoch(0)
    with pytest.raises(ValueError, match="Unknown communication phases"):
        Prediction("d", 1, 1, 0.0, {"bogus": 1.0}, 0.0, 0, {}, True, ())


def test_oversubscription_and_overhead():
    m = M.replace(compute_slots=2, step_overhead_s=0.5)
    r = predict(PROF, "d", 4, 4, m)
    assert r.compute_s == pytest.approx(12.0 * 2) and r.overhead_s == 0.5 * 2
    assert r.total_s == pytest.approx(r.compute_s + r.comm_total_s + 1.0)
    assert predict(PROF, "serial", 4, 4, m).compute_s == 48.0
    assert predict(PROF, "serial", 4, 4, m).overhead_s == 0.5


def test_measured_contention_replaces_the_slots_model():
    m = M.replace(compute_slots=2, step_overhead_s=0.5, compute_contention={"4": 2.5})
    r = predict(PROF, "d", 4, 4, m)
    assert r.compute_s == pytest.approx(12.0 * 2.5) and r.overhead_s == pytest.approx(1.25)
    # a rank count calibration did not measure falls back to ranks / slots
    assert predict(PROF, "d", 2, 4, m).compute_s == pytest.approx(24.0)
    assert Machine.from_dict(m.to_dict()) == m
    for bad, msg in (({"x": 2.0}, "not a positive rank count"), ({"4": 0}, "positive finite"),
                     ([2.0], "must map ranks")):
        with pytest.raises(ValueError, match=msg):
            M.replace(compute_contention=bad)


def test_fixed_compute_added_once_per_iteration_and_oversubscribed():
    m = M.replace(compute_fixed_s=3.0, compute_slots=2)
    assert predict(PROF, "serial", 1, 4, m).compute_s == pytest.approx(48.0 + 3.0)
    assert predict(PROF, "f", 2, 4, m).compute_s == pytest.approx(24.0 + 3.0)
    assert predict(PROF, "d", 4, 4, m).compute_s == pytest.approx((12.0 + 3.0) * 2)


def test_layer_times_override_flops():
    m = M.replace(layer_times={"fc1": (1.0, 2.0)})
    r = predict(PROF, "serial", 1, 2, m)
    assert r.compute_s == pytest.approx(2 * (3.0 + 6.0))


def test_replicated_fc_lee():
    r = predict(PROF, "d", 2, 4, M, replicated_fc=1)
    assert r.options["replicated_fc"][0] == {"layer": "fc1", "allreduce_items": 8,
                                             "allgather_items": 24}
    assert r.comm_s["GE-allreduce"] == pytest.approx(2 * (1 + 10 / 2 * 0.5))
    assert r.comm_s["FB-allgather"] == pytest.approx(1 + 2 * 6 * 0.5)


def test_deprecated_option_spellings_still_work_and_warn():
    """batch= and grid= (s/ds) are the old spellings of batch_size= and spatial=."""
    with pytest.warns(DeprecationWarning, match="'batch' is deprecated; use 'batch_size'"):
        old = predict(CPROF, "s", 2, batch=4, machine=M, spatial=(2, 1))
    with pytest.warns(DeprecationWarning, match="'grid' is deprecated; use 'spatial'"):
        old_grid = predict(CPROF, "ds", 4, 4, M, grid=(2, 2, 1))
    assert old.total_s == predict(CPROF, "s", 2, 4, M, spatial=(2, 1)).total_s
    assert old_grid.total_s == predict(CPROF, "ds", 4, 4, M, spatial=(2, 1)).total_s
    by_name = predict(CPROF, "s", 2, 4, M, spatial="height")
    assert by_name.options["grid"]["spatial"] == [2, 1]


def test_gmp_b_scheme_hand():
    r = predict(PROF, "gmp", 2, 4, M, mp=2, scheme="B", ccr_threshold=0)
    b_over_k = predict(PROF, "gmp", 2, 4, M, mp=2, scheme="B/K", ccr_threshold=0)
    assert r.options["scheme"] == "B" and r.options["pairs"] == [("fc1", "fc2")]
    # 2 rounds of one rank's 2 samples: broadcast of x=2 (forward and its recompute, a
    # tree of 1 hop) and the rooted reduce of its gradient; the outputs' gradient (y=2)
    # broadcast back; the pair's allreduce of y_fc2 for 2 samples, twice (recompute)
    assert r.comm_s["FB-allgather"] == pytest.approx(2 * (2 * 3 + 3) + 2 * 3)
    assert r.comm_s["FB-allreduce"] == pytest.approx(2 * 2 * 2 * (1 + 4 / 2 * 0.5))
    assert r.memory_bytes == b_over_k.memory_bytes      # activations of b samples
    assert r.compute_s > b_over_k.compute_s             # each round's forward recomputed


def test_pipeline_schedule_overlaps_transfers_and_shares_cores_by_active_stages():
    from tfhybrid.oracle.schedule import fill_drain
    # transfers hide behind the sender's next micro-batch: 1 s links cost 2 x 1 on the
    # critical path (first micro-batch forward, last backward), not 2 (S + M - 2)
    free = fill_drain([2.0] * 2, [2.0] * 2, 4, [0.0], lambda n: 1.0)
    assert free == pytest.approx((2 + 4 - 1) * 4)
    assert fill_drain([2.0] * 2, [2.0] * 2, 4, [1.0], lambda n: 1.0) == pytest.approx(free + 2)
    # processor sharing: two stages computing at once each run at half speed
    assert fill_drain([1.0, 1.0], [1.0, 1.0], 2, [0.0], lambda n: float(n)) == 8.0
    # 4 stages, 2 micro-batches on 2 compute slots: never more than 2 stages at once,
    # so the pipeline is not slowed although 4 ranks share the node
    m = M.replace(compute_slots=2)
    prof = ModelProfile("four", tuple(dataclasses.replace(FC1, name=f"fc{i}") for i in range(4)), 2)
    r = predict(prof, "p", 4, 4, m, segments=2)
    assert r.compute_s == pytest.approx((4 + 2 - 1) * 2 * 6.0)


def test_layer_separation_slows_each_side_by_its_own_concurrency():
    conv = LayerRow("c1", "conv", 20, 18, 2, 64, 128, 8, 8, 1, 2, (2, 2), (2, 2), (1, 1), (1, 1))
    prof = ModelProfile("cf", (conv, FC1), 8)
    m = M.replace(compute_contention={"2": 1.5, "4": 3.0})
    r = predict(prof, "ls", 4, 4, m, n_f=2)
    K = 4 / 2
    fb_c, fb_f = 192 / 8, 48 / 8
    # 2 CONV workers compute at once (x1.5), then 2 FC workers (x1.5): never all 4
    assert r.compute_s == pytest.approx(1.5 * K * fb_c + 1.5 * (2 / 2) * K * fb_f)
    assert predict(prof, "d", 4, 4, m).compute_s == pytest.approx(3.0 * 1 * (fb_c + fb_f))


def test_profile_marks_channels_last_global_pooling():
    import keras

    from tfhybrid.oracle.profile import profile

    i = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(i)
    a = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    m = keras.layers.GlobalMaxPooling2D(name="gmp")(x)
    rows = {r.name: r for r in profile(keras.Model(i, [a, m])).rows}
    assert rows["gap"].global_pool == "average" and rows["gmp"].global_pool == "max"
    assert rows["conv"].global_pool == ""

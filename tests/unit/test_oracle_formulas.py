"""Paper formulas (tfhybrid.oracle.formulas, machine costs) vs hand computation and
the papers' / ParaDL's published numbers."""
import math

import pytest

from tfhybrid.oracle import formulas as F
from tfhybrid.oracle.machine import Machine

D = 1.28e6
W_VGG = 169801408          # ParaDL's VGG16 |w| ("Total |w|" in its log)


def test_ring_collectives_hand_computed():
    m = Machine(alpha=1e-5, beta=1e-9, flop_rate=1.0)
    assert m.t_allreduce(4, 4e6) == pytest.approx(2 * 3 * (1e-5 + 1e6 * 1e-9))
    assert m.t_allgather(4, 1e6) == pytest.approx(3 * (1e-5 + 1e6 * 1e-9))
    assert m.t_reducescatter(4, 4e6) == pytest.approx(3 * (1e-5 + 1e6 * 1e-9))
    assert m.t_alltoall(4, 4e6) == pytest.approx(3 * (1e-5 + 1e6 * 1e-9))
    assert m.t_p2p(100) == pytest.approx(1e-5 + 1e-7)
    assert m.t_allreduce(1, 1e9) == 0.0 and m.t_allgather(1, 1e9) == 0.0
    assert m.t_allreduce(4, 0) == 0.0
    assert m.t_allreduce(2, 2e6, phi=2) == pytest.approx(2 * (1e-5 + 1e6 * 1e-9 * 2))


def test_tiers_pick_by_span():
    m = Machine(alpha=1.0, beta=2.0, flop_rate=1.0,
                tiers=({"max_ranks": 68, "alpha": 3.031e-5, "beta": 4e-11},
                       {"max_ranks": 4, "alpha": 9e-6, "beta": 1e-11}))
    assert m.alpha_beta(2) == (9e-6, 1e-11)
    assert m.alpha_beta(4) == (9e-6, 1e-11)
    assert m.alpha_beta(5) == (3.031e-5, 4e-11)
    assert m.alpha_beta(1000) == (1.0, 2.0)
    assert m.t_allreduce(2, 8, span=64) == pytest.approx(2 * (3.031e-5 + 4 * 4e-11))


def test_paradl_data_comm_eq6_vs_log():
    # data_vgg_scaling_proj.log, p=2: (p-1)alpha = 9e-06, (p-1)|W|delta beta/p = 0.00339602816
    per_iter = F.paradl_data_comm(D, 64, 2, W_VGG, 9e-6, 1e-11) / (D / 64)
    assert per_iter == pytest.approx(2 * (9e-6 + 0.00339602816), rel=1e-12)
    # p=8 line: 0.00021217 and 0.02377219712 with the 68-rank tier
    per8 = F.paradl_data_comm(D, 256, 8, W_VGG, 3.031e-5, 4e-11) / (D / 256)
    assert per8 == pytest.approx(2 * (0.00021217 + 0.02377219712), rel=1e-9)


def test_paradl_tool_doubles_bandwidth_term():
    """ParaDL's SUMMARY Tcomm (272.0422528 s, VGG, p=2, B=64) = Eq. 6 with 2x the bandwidth."""
    tool = 2 * (D / 64) * (2 - 1) * (9e-6 + 2 * W_VGG * 4 * 1e-11 / 2)
    assert tool == pytest.approx(272.0422528, rel=1e-9)
    assert F.paradl_data_comm(D, 64, 2, W_VGG, 9e-6, 1e-11) == pytest.approx(136.2011264)


def test_paradl_filter_comm_eq15_and_df_eq22():
    ys = [10.0, 20.0]
    got = F.paradl_filter_comm(100, 10, 4, ys, alpha=1.0, beta=0.5, delta=2)
    want = 3 * 10 * 3 * ((1 + 10 * 10 / 4 * 2 * 0.5) + (1 + 10 * 20 / 4 * 2 * 0.5))
    assert got == pytest.approx(want)
    df = F.paradl_df_comm(100, 10, 2, 2, ys, W=40, alpha=1.0, beta=0.5, delta=2, phi=2)
    model = 3 * 10 * 1 * sum(1 + 10 * y / 4 * 2 * 0.5 for y in ys)
    data = 2 * 10 * 1 * (1 + 40 / 4 * 2 * 0.5 * 2)
    assert df == pytest.approx(model + data)


def test_paradl_filter_tool_fit_vgg():
    """The tool's VGG filter Tcomm (2155.10112 s at p=2) = 3(D/B)(p-1) sum over the 13 conv
    layers of (alpha + 2 B |y_l| delta beta / p) (bandwidth doubled again)."""
    conv_y = [3268864] * 2 + [1634432] * 2 + [831744] * 3 + [430592] * 3 + [115200] * 3
    tool = F.paradl_filter_comm(D, 32, 2, conv_y, 9e-6, 2e-11)
    assert tool == pytest.approx(2155.10112, rel=1e-9)


def test_paradl_halo_pipeline_memory():
    assert F.paradl_spatial_halo(100, 10, [(3, 5)], alpha=1, beta=0.1, delta=4) == \
        pytest.approx(2 * 10 * (2 + 10 * 4 * 0.1 * 8))
    assert F.paradl_pipeline_comp(100, 2, 4, [1.0, 2.0], [2.0, 3.0], [0.5, 0.1]) == \
        pytest.approx(100 * 5 / 4 * (2 + 3 + 0.5))
    assert F.paradl_pipeline_comm(100, 10, 2, 5, [4.0, 1.0], alpha=1, beta=0.5, delta=2) == \
        pytest.approx(2 * 100 * 5 / 10 * (1 + 10 / 5 * 4 * 2 * 0.5))
    assert F.paradl_pipeline_comm(100, 10, 1, 5, [4.0], 1, 1) == 0.0
    rows = [(2, 3, 10, 1), (3, 1, 4, 0)]
    assert F.paradl_memory(rows, B=4, delta=2, gamma=0.5, act_div=2, w_div=2) == \
        pytest.approx(0.5 * 2 * ((2 * 4 * 5 / 2 + 10 + 1) + (2 * 4 * 4 / 2 + 4)))


def test_paradl_serial_memory_vgg_matches_log():
    """VGG16 B=32 serial: 9360484864 bytes with ParaDL's Total |x| 15705164, |y| 15552936."""
    got = F.paradl_memory([(15705164, 15552936, W_VGG, 0)], B=32, delta=4)
    assert got == 9360484864


def test_gholami_equations_hand_computed():
    a, b = 1.0, 0.01
    assert F.gholami_model_comm(4, 8, [100, 50], a, b) == pytest.approx(
        3 * ((2 + 8 * 0.75 * 0.01 * 100) + (2 + 8 * 0.75 * 0.01 * 50)))
    assert F.gholami_batch_comm(4, [1000], a, b) == pytest.approx(2 * (2 + 0.75 * 10))
    assert F.gholami_15d_comm(2, 4, 8, [100], [1000], a, b) == pytest.approx(
        3 * (1 + 8 * 0.5 * 0.01 * 100 / 4) + 2 * (2 + 0.75 * 0.01 * 1000 / 2))
    # Eq. 5 with Pc = 1 is Eq. 2; with Pr = 1 it is Eq. 3
    assert F.gholami_15d_comm(4, 1, 8, [100], [0], a, b) == pytest.approx(
        F.gholami_model_comm(4, 8, [100], a, b))
    assert F.gholami_15d_comm(1, 4, 8, [0], [1000], a, b) == pytest.approx(
        F.gholami_batch_comm(4, [1000], a, b) + 3 * 0)
    halo = [(10, 3, 10, 8, 3, 3)]
    assert F.gholami_domain_comm(4, 2, halo, [1000], a, b) == pytest.approx(
        2 + 0.01 * 2 * (30 + 80) + F.gholami_batch_comm(4, [1000], a, b))
    eq6 = F.gholami_integrated_comm(2, 2, 8, [100], [1000], halo, [50], a, b)
    assert eq6 == pytest.approx(F.gholami_15d_comm(2, 2, 8, [100], [1000], a, b)
                                + 2 + 0.01 * 4 * 110 + 2 * (2 + 0.75 * 0.01 * 50))


def test_stanza_equations():
    assert [F.stanza_rounds(n) for n in (1, 2, 4, 5, 6, 8)] == [0, 1, 2, 4, 4, 3]
    assert F.stanza_compute(1.0, 0.5, 6, 2) == pytest.approx(2.5)
    t = F.stanza_iteration(1.0, 0.5, 4, 2, A=100, K=8, P_c=1000, bw=1e4)
    assert t == pytest.approx(1.0 + 1.0 + 2 * 4 * 100 * 8 / (2 * 1e4) + 1000 * 2 / 1e4)
    assert F.stanza_throughput(4, 8, 2.0) == 16.0
    assert F.ps_iteration(4, 2, 1000, 1e4, 0.5) == pytest.approx(2 * 4 * 1000 / 2e4 + 0.5)
    assert F.ps_throughput(4, 8, 2.0) == 16.0

    def time_of(n_c, n_f):
        return F.stanza_iteration(1.0, 0.5, n_c, n_f, 100, 8, 1000, 1e4), n_c * 8
    n_c, n_f, thr = F.stanza_best_assignment(8, time_of)
    brute = max(((8 - f) * 8 / time_of(8 - f, f)[0], f) for f in range(1, 8))
    assert (n_f, thr) == (brute[1], pytest.approx(brute[0])) and n_c + n_f == 8


def test_lee_message_sizes_published():
    """Lee et al.: VGG-A FC1 102,760,448 weights vs (K_b + K_c) N = 7,471,104 at N = 256."""
    assert F.lee_fc_message_sizes(25088, 4096, 256) == (102760448, 7471104)


def test_splitbrain_param_memory():
    conv, fc = 1734336, 5253120   # Table 1 (kernel parameters)
    assert F.splitbrain_param_memory(conv, fc, 1) == 4 * (conv + fc)
    assert F.splitbrain_param_memory(conv, fc, 4) == pytest.approx(4 * (conv + fc / 4))
    assert math.isclose(fc / (conv + fc), 0.7518, abs_tol=2e-4)   # paper: 75.17%

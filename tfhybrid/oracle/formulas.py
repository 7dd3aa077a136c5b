"""The papers' closed-form cost formulas, as small pure functions.

Each function is one equation, named after it, in the papers' own variables,
so unit tests can check it against hand computation and published numbers.
The strategy models in :mod:`tfhybrid.oracle.strategies` combine per-layer
versions of these; this module is the reference for what each paper says.

* ParaDL (Table 3 / Appendix A), per **epoch** of ``D`` samples, global batch
  ``B``: :func:`paradl_data_comm` (Eq. 6), :func:`paradl_filter_comm`
  (Eq. 15 and 19), :func:`paradl_df_comm` (Eq. 22),
  :func:`paradl_spatial_halo` (Eq. 10), :func:`paradl_pipeline_comp` and
  :func:`paradl_pipeline_comm` (Eq. 12-13), :func:`paradl_memory`
  (Eq. 4, 7, 8, 14, 16, 17, 20).
* Gholami et al. Eq. 2-6: :func:`gholami_model_comm`,
  :func:`gholami_batch_comm`, :func:`gholami_domain_comm`,
  :func:`gholami_15d_comm`, :func:`gholami_integrated_comm` (per iteration;
  ``beta`` is per item there, as in the paper).
* Stanza Eq. 2-7: :func:`stanza_compute`, :func:`stanza_iteration`,
  :func:`stanza_throughput`, :func:`stanza_best_assignment`,
  :func:`ps_iteration`, :func:`ps_throughput` (bandwidth ``bw`` in items/s).
* SplitBrain group model parallelism: :func:`splitbrain_param_memory`,
  :func:`splitbrain_ccr` and :func:`splitbrain_partitions` (which Dense layers
  ``gmp`` partitions; the transformer imports these, so what the oracle prices
  is what ``transform`` builds).
* Lee et al. replicated FC gradients: :func:`lee_fc_message_sizes`.

Approximations are the papers' own: ring collectives, no overlap, no
congestion beyond ParaDL's phi, tree allreduce rounds in Stanza.

Example:
    >>> round(paradl_data_comm(D=1.28e6, B=64, p=2, W=169801408, alpha=9e-6,
    ...                        beta=1e-11, delta=4), 4)
    136.2011
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence


# -- ParaDL (Table 3, Appendix A), per epoch ----------------------------------

def paradl_data_comm(D, B, p, W, alpha, beta, delta=4):
    """Eq. 6: 2 (D/B) (p - 1) (alpha + W/p delta beta)."""
    return 2 * D / B * (p - 1) * (alpha + W / p * delta * beta)


def paradl_filter_comm(D, B, p, ys: Iterable[float], alpha, beta, delta=4):
    """Eq. 15 / 19 (filter and channel): 3 (D/B) (p-1) sum_{l<G} (alpha + B|y_l|/p delta beta).

    ``ys`` are |y_l| of layers 1..G-1 (the last layer excluded by the caller).
    """
    return 3 * D / B * (p - 1) * sum(alpha + B * y / p * delta * beta for y in ys)


def paradl_df_comm(D, B, p1, p2, ys: Iterable[float], W, alpha, beta, delta=4, phi=1.0):
    """Eq. 22 (Table 3 row Data+Filter) with contention phi on the data allreduce.

    3 (D/B)(p2-1) sum_{l<G}(alpha + B|y_l|/p delta beta)
    + 2 (D/B)(p1-1)(alpha + W/p delta beta phi),  p = p1 p2.
    """
    p = p1 * p2
    model = 3 * D / B * (p2 - 1) * sum(alpha + B * y / p * delta * beta for y in ys)
    data = 2 * D / B * (p1 - 1) * (alpha + W / p * delta * beta * phi)
    return model + data


def paradl_spatial_halo(D, B, halos: Iterable[tuple], alpha, beta, delta=4):
    """Eq. 10: 2 (D/B) sum_l (2 alpha + B delta beta (halo(x_l) + halo(dL/dy_l)))."""
    return 2 * D / B * sum(2 * alpha + B * delta * beta * (hx + hdy) for hx, hdy in halos)


def paradl_pipeline_comp(D, p, S, fw_groups, bw_groups, wu_groups):
    """Eq. 12: D (p+S-1)/S (max FW_Gi + max BW_Gi + max WU_Gi) (FW, BW per sample)."""
    return D * (p + S - 1) / S * (max(fw_groups) + max(bw_groups) + max(wu_groups))


def paradl_pipeline_comm(D, B, p, S, y_groups, alpha, beta, delta=4):
    """Eq. 13: 2 D (p+S-2)/B max_{i<p} (alpha + B/S |y_Gi| delta beta)."""
    if p <= 1:
        return 0.0
    worst = max(alpha + B / S * y * delta * beta for y in y_groups[:p - 1])
    return 2 * D * (p + S - 2) / B * worst


def paradl_memory(rows: Sequence[tuple], B, delta=4, gamma=1.0, act_div=1, w_div=1):
    """Table 3 memory: gamma delta sum_l (2 B (|x|+|y|)/act_div + 2|w|/w_div + |bi|).

    ``rows`` are (|x_l|, |y_l|, |w_l|, |bi_l|). serial: act_div=w_div=1; data and
    spatial: act_div=p; filter/channel: w_div=p; df: act_div=p1, w_div=p2.
    """
    return gamma * delta * sum(2 * B * (x + y) / act_div + 2 * w / w_div + bi
                               for x, y, w, bi in rows)


# -- Gholami et al., per iteration (beta per item) ----------------------------

def _log2c(p):
    return math.ceil(math.log2(p)) if p > 1 else 0


def gholami_model_comm(P, B, d, alpha, beta):
    """Eq. 2: 3 sum_i (alpha ceil(log P) + |B| (P-1)/P beta d_i)."""
    return 3 * sum(alpha * _log2c(P) + B * (P - 1) / P * beta * di for di in d)


def gholami_batch_comm(P, W, alpha, beta):
    """Eq. 3: 2 sum_i (alpha ceil(log P) + (P-1)/P beta |W_i|)."""
    return 2 * sum(alpha * _log2c(P) + (P - 1) / P * beta * w for w in W)


def gholami_domain_comm(P, B, halo_layers, W, alpha, beta):
    """Eq. 4: sum_i (alpha + beta B X_W X_C floor(k_h/2)) + sum_i (alpha + beta B Y_W Y_C
    floor(k_w/2)) + Eq. 3.  ``halo_layers``: (X_W, X_C, Y_W, Y_C, k_h, k_w) per layer.
    """
    halo = sum(2 * alpha + beta * B * (xw * xc * (kh // 2) + yw * yc * (kw // 2))
               for xw, xc, yw, yc, kh, kw in halo_layers)
    return halo + gholami_batch_comm(P, W, alpha, beta)


def gholami_15d_comm(Pr, Pc, B, d, W, alpha, beta):
    """Eq. 5 (1.5D, Pr model x Pc batch):
    3 sum (alpha ceil(log Pr) + B (Pr-1)/Pr beta d_i/Pc)
    + 2 sum (alpha ceil(log Pc) + (Pc-1)/Pc beta |W_i|/Pr).
    """
    model = 3 * sum(alpha * _log2c(Pr) + B * (Pr - 1) / Pr * beta * di / Pc for di in d)
    batch = 2 * sum(alpha * _log2c(Pc) + (Pc - 1) / Pc * beta * w / Pr for w in W)
    return model + batch


def gholami_integrated_comm(Pr, Pc, B, d_m, W_m, halo_d, W_d, alpha, beta):
    """Eq. 6: Eq. 5 over the model-parallel layers L_M, halo exchanges with batch B/Pc
    over the domain-parallel layers L_D, and an allreduce over all P of their weights.
    """
    P = Pr * Pc
    total = gholami_15d_comm(Pr, Pc, B, d_m, W_m, alpha, beta)
    total += sum(2 * alpha + beta * B / Pc * (xw * xc * (kh // 2) + yw * yc * (kw // 2))
                 for xw, xc, yw, yc, kh, kw in halo_d)
    total += 2 * sum(alpha * _log2c(P) + (P - 1) / P * beta * w for w in W_d)
    return total


# -- Stanza (layer separation), per iteration --------------------------------

def stanza_compute(T_c, T_f, n_c, n_f):
    """Eq. 2: t_s^c = T_c + (n_c / n_f) T_f."""
    return T_c + n_c / n_f * T_f


def stanza_rounds(n_c) -> int:
    """CONV-worker allreduce rounds: log2 n_c if a power of two, else floor(log2 n_c) + 2."""
    if n_c <= 1:
        return 0
    lg = math.log2(n_c)
    return int(lg) if lg.is_integer() else int(math.floor(lg)) + 2


def stanza_iteration(T_c, T_f, n_c, n_f, A, K, P_c, bw):
    """Eq. 3: t_s = t_s^c + 2 n_c A K / (n_f bw) + P_c rounds(n_c) / bw."""
    return (stanza_compute(T_c, T_f, n_c, n_f) + 2 * n_c * A * K / (n_f * bw)
            + P_c * stanza_rounds(n_c) / bw)


def stanza_throughput(n_c, K, t_s):
    """Eq. 4: n_c K / t_s samples per second."""
    return n_c * K / t_s


def stanza_best_assignment(N, time_of):
    """Eq. 5: the (n_c, n_f) with n_c + n_f = N maximising throughput.

    ``time_of(n_c, n_f)`` returns (t_s, samples per iteration); exhaustive search
    as in the paper. Returns (n_c, n_f, throughput).
    """
    best = None
    for n_f in range(1, N):
        n_c = N - n_f
        t_s, samples = time_of(n_c, n_f)
        thr = samples / t_s
        if best is None or thr > best[2]:
            best = (n_c, n_f, thr)
    return best


def ps_iteration(n_w, n_s, P, bw, T_ps):
    """Eq. 6: t_ps = 2 n_w P / (n_s bw) + T_ps."""
    return 2 * n_w * P / (n_s * bw) + T_ps


def ps_throughput(n_w, K, t_ps):
    """Eq. 7: n_w K / t_ps."""
    return n_w * K / t_ps


# -- SplitBrain and Lee et al. ------------------------------------------------

SPLITBRAIN_CCR_THRESHOLD = 64.0
"""Default CCR (FLOP per byte) from which ``gmp`` partitions a Dense layer."""


def splitbrain_ccr(n_in, n_out, delta=4):
    """SplitBrain's computation-to-communication ratio of a Dense layer.

    FLOPs per example of forward and backward (``6 n_in n_out``: the forward
    matmul and the input- and weight-gradient matmuls, 2 FLOPs per
    multiply-add) over the bytes per example a partitioned layer moves (its
    input and output activations, ``delta (n_in + n_out)``). Bias and
    activation FLOPs are left out: the decision must not depend on them.

    Args:
        n_in: input features of the layer.
        n_out: units of the layer.
        delta: bytes per activation item (4 for float32, what the layers move).

    Returns:
        FLOP per byte; 0.0 when either size is 0 or unknown (None).

    Example:
        >>> round(splitbrain_ccr(4096, 1024), 1)   # SplitBrain's FC0 of VGG
        1228.8
    """
    if not n_in or not n_out:
        return 0.0
    return 6.0 * n_in * n_out / (delta * (n_in + n_out))


def splitbrain_partitions(ccr, threshold=SPLITBRAIN_CCR_THRESHOLD):
    """Whether ``gmp`` partitions a Dense layer of this CCR (at the threshold: yes).

    Example:
        >>> splitbrain_partitions(64.0, 64.0), splitbrain_partitions(63.9, 64.0)
        (True, False)
    """
    return ccr >= threshold


def splitbrain_param_memory(conv_params, fc_params, mp, delta=4):
    """Parameter memory per worker under group MP: delta (conv + fc / mp)."""
    return delta * (conv_params + fc_params / mp)


def lee_fc_message_sizes(K_b, K_c, N):
    """Lee et al.: gradient allreduce moves K_b K_c weights; replicated gradient
    computation allgathers (K_b + K_c) N activations and errors instead.

    Example:
        >>> lee_fc_message_sizes(25088, 4096, 256)
        (102760448, 7471104)
    """
    return K_b * K_c, (K_b + K_c) * N

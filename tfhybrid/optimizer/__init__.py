"""Data-parallel gradient reduction for Keras 3 (``tfhybrid.DistributedOptimizer``).

Modules: :mod:`~tfhybrid.optimizer.distributed` (the optimizer wrapper),
:mod:`~tfhybrid.optimizer.reduction` (per-layout reduction rule and fusion
bucket planning, pure Python), :mod:`~tfhybrid.optimizer.replicated_fc`
(Lee et al.'s replicated FC gradient computation; their delayed FC update is
``DistributedOptimizer(delay_fc_update=True)``),
:mod:`~tfhybrid.optimizer.compression` (how gradients travel: ``Compression.none``,
``Compression.fp16`` or a user-defined :class:`Compressor`).
"""
from tfhybrid.optimizer.compression import Compression, Compressor
from tfhybrid.optimizer.distributed import (DEFAULT_BUCKET_BYTES, DistributedOptimizer,
                                            disable_xla, in_xla_context, is_delayed_fc,
                                            mark_delayed_fc)
from tfhybrid.optimizer.reduction import (Bucket, Reduction, is_prereduced, mark_prereduced,
                                          plan_buckets, reduction_of)
from tfhybrid.optimizer.replicated_fc import replicate_fc_gradients

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_BYTES", "disable_xla", "in_xla_context",
           "Bucket", "Reduction", "plan_buckets", "reduction_of", "mark_prereduced",
           "is_prereduced", "replicate_fc_gradients", "Compression", "Compressor",
           "mark_delayed_fc", "is_delayed_fc"]

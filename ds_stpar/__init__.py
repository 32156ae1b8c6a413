"""ds_stpar: spatial-temporal tensor partitioning, a parallel-layout planner and
sequence-length bucketing with parallelism hot switching for DeepSpeed and Megatron-core."""

__version__ = "0.1.0"

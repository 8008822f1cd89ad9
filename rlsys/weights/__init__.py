"""Weight updates from the trainer to the rollout engines: buckets (buckets.py), a process group of their
own (group.py), the transports (transfer.py), and a run's publishing of each version (sync.py, which needs
Ray and is imported by itself)."""
from rlsys.weights.buckets import BucketPlan, TensorMeta, fill_buckets, iter_buckets, pack, plan_buckets, unpack
from rlsys.weights.group import WeightGroup, WeightTransferTimeout
from rlsys.weights.transfer import (TRANSPORTS, Receiver, Sender, Transport, WeightUpdate, make_transport)

__all__ = ["BucketPlan", "Receiver", "Sender", "TRANSPORTS", "TensorMeta", "Transport", "WeightGroup",
           "WeightTransferTimeout", "WeightUpdate", "fill_buckets", "iter_buckets", "make_transport", "pack",
           "plan_buckets", "unpack"]

"""Weight updates from the trainer to the rollout engines: buckets (buckets.py), a process group of their
own (group.py) and the transports (transfer.py)."""
from rlsys.weights.buckets import BucketPlan, TensorMeta, iter_buckets, pack, plan_buckets, unpack
from rlsys.weights.group import WeightGroup, WeightTransferTimeout
from rlsys.weights.transfer import CudaIpcTransfer, NCCLTransfer, ObjectStoreTransfer, WeightTransfer

__all__ = ["BucketPlan", "CudaIpcTransfer", "NCCLTransfer", "ObjectStoreTransfer", "TensorMeta", "WeightGroup",
           "WeightTransfer", "WeightTransferTimeout", "iter_buckets", "pack", "plan_buckets", "unpack"]

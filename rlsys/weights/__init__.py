"""Weight updates from the trainer to the rollout engines: buckets (buckets.py), a process group of their
own (group.py), the transports (transfer.py), and a run's publishing of each version (sync.py, which needs
Ray and is imported by itself)."""
from rlsys.weights.buckets import BucketPlan, TensorMeta, iter_buckets, pack, plan_buckets, unpack
from rlsys.weights.group import WeightGroup, WeightTransferTimeout
from rlsys.weights.transfer import (CudaIpcTransfer, NCCLTransfer, ObjectStoreTransfer, WeightTransfer, WeightUpdate,
                                    make_transfer)

__all__ = ["BucketPlan", "CudaIpcTransfer", "NCCLTransfer", "ObjectStoreTransfer", "TensorMeta", "WeightGroup",
           "WeightTransfer", "WeightTransferTimeout", "WeightUpdate", "iter_buckets", "make_transfer", "pack",
           "plan_buckets", "unpack"]

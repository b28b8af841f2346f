"""Running one model over several processes: the collectives (:mod:`~xllm.core.parallel.comm`, the
native shared-memory one :mod:`~xllm.core.parallel.shm`) and the ranks' proof of the cluster
credential (:mod:`~xllm.core.parallel.trust`)."""

from xllm.core.parallel.comm import CollectiveError, Communicator, GlooComm, GroupAddress, SingleRank
from xllm.core.parallel.shm import ShmComm

__all__ = ["CollectiveError", "Communicator", "GlooComm", "GroupAddress", "ShmComm", "SingleRank"]

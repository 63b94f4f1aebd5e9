"""Gradient compression for DDP's all-reduce, as DDP communication hooks.

bf16: each gradient bucket is cast to bfloat16 into a buffer kept per bucket, summed
across replicas in bfloat16, cast back into the bucket and divided by the replica count
in fp32, chunk by chunk, so casting one chunk overlaps the all-reduce of the previous one
and casting back runs as each chunk arrives. bfloat16 has fp32's range, so summing
before dividing cannot overflow.

torch's ``bf16_compress_hook`` casts the same way but is unfit on CPU twice over:
``DistributedDataParallel.register_comm_hook`` refuses any hook of that name without
CUDA and NCCL (gloo all-reduces bfloat16 fine), and it divides in bfloat16 arithmetic on
a tensor allocated afresh each step. Measured here, one core, the 20M gradients of the
MLP 784-4096-4096-10: its cast, divide and cast back take about 125 ms a step, ours
25-40 ms, while halving the bytes saves 25-40 ms of all-reduce on loopback. On this
machine every cycle spent casting is taken from the same two cores that move the bytes,
so compression gains little over fp32 (see benchmarks/allreduce.py); it pays where the
network, not memory, is the bottleneck.

fp16 keeps torch's ``fp16_compress_hook`` (divide first, since float16 overflows past
65504), under another name for the same reason.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with
the ``GradBucket`` and ``Future[Tensor]`` objects, and postponed annotations are strings.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket, ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from clusterflow.collective.api import AllReduceAlgorithm, CommunicationOptions, Compression
from clusterflow.collective.bucket_worker import BucketWorker
from clusterflow.collective.hierarchy import HierarchicalSum
from clusterflow.errors import ConfigError

__all__ = [
    "CastState",
    "bf16_allreduce_hook",
    "bucket_worker_hook",
    "check_algorithm",
    "fp16_allreduce_hook",
    "register_communication",
    "register_compression",
]


class CastState:
    """Per-model state of :func:`bf16_allreduce_hook`: the group, chunking, wire buffers.

    A bucket's wire buffer is reused every step (DDP re-forms buckets once, after the
    first step; a size change reallocates it); buckets in flight at once never share one.

    Args:
        group: the process group (None: the default group).
        chunk_elements: gradients per chunk. 2M (8 MiB of fp32) was measured here against
            whole buckets and 4M: small enough to overlap casting with sending, large
            enough that per-collective costs stay small.
    """

    def __init__(
        self,
        group: ProcessGroup | None,
        *,
        dtype: torch.dtype = torch.bfloat16,
        chunk_elements: int = 2**21,
    ) -> None:
        self.group = group
        self.dtype = dtype
        self.chunk_elements = chunk_elements
        self.buffers: dict[int, torch.Tensor] = {}

    def wire_buffer(self, bucket: torch.Tensor, index: int) -> torch.Tensor:
        wire = self.buffers.get(index)
        if wire is None or wire.numel() != bucket.numel() or wire.device != bucket.device:
            wire = torch.empty(bucket.shape, dtype=self.dtype, device=bucket.device)
            self.buffers[index] = wire
        return wire


def bf16_allreduce_hook(state: CastState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduces ``bucket`` in bfloat16, chunk by chunk; the bucket ends as the fp32 mean."""
    buffer = bucket.buffer()
    wire = state.wire_buffer(buffer, bucket.index())
    replicas = dist.get_world_size(state.group)
    chunks = []
    size = state.chunk_elements
    for grads, sent in zip(torch.split(buffer, size), torch.split(wire, size), strict=True):
        sent.copy_(grads)
        work = dist.all_reduce(sent, group=state.group, async_op=True)
        if work is None:  # async_op=True always returns the work; this narrows the type
            raise RuntimeError("all_reduce(async_op=True) returned no work")
        chunks.append(work.get_future().then(_decompress(grads, sent, replicas)))
    done: torch.futures.Future[torch.Tensor] = torch.futures.collect_all(chunks).then(
        lambda _: buffer
    )
    return done


def _decompress(
    grads: torch.Tensor, summed: torch.Tensor, replicas: int
) -> Callable[[torch.futures.Future[list[torch.Tensor]]], torch.Tensor]:
    def run(_: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        grads.copy_(summed)  # runs on the thread that finished the chunk's all-reduce
        return grads.div_(replicas)

    return run


def fp16_allreduce_hook(
    state: ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_hook``: divide, cast to float16, all-reduce, cast back."""
    return default_hooks.fp16_compress_hook(state, bucket)  # type: ignore[arg-type]


def register_compression(
    model: DistributedDataParallel, compression: Compression, group: ProcessGroup | None
) -> None:
    """Installs ``compression`` on ``model``; call once, right after wrapping, before a step."""
    if compression is Compression.BF16:
        model.register_comm_hook(CastState(group), bf16_allreduce_hook)
    elif compression is Compression.FP16:
        model.register_comm_hook(group, fp16_allreduce_hook)


def bucket_worker_hook(
    state: BucketWorker, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Hands the bucket to the model's worker thread (``collective/bucket_worker.py``)."""
    return state.submit(bucket.buffer())


def check_algorithm(algorithm: AllReduceAlgorithm, backend: str) -> None:
    """Refuses clusterflow's own algorithms on a backend they were not built for.

    Raises:
        ConfigError: ``algorithm`` is clusterflow's and ``backend`` is not gloo. NCCL
            already reduces inside a host first, over the GPUs' own links; issuing its
            collectives from another thread would also need that thread's CUDA stream
            ordered against the backward pass, which nothing here does.
    """
    if algorithm is not AllReduceAlgorithm.BACKEND and backend != "gloo":
        raise ConfigError(
            f"CommunicationOptions(algorithm={algorithm.value!r}) runs over gloo, but this "
            f"group's backend is {backend}; {backend}'s own all-reduce already reduces "
            "inside each host first: use algorithm='backend'"
        )


def register_communication(
    model: DistributedDataParallel,
    options: CommunicationOptions,
    local_rank: int,
    local_world_size: int,
) -> BucketWorker | None:
    """Installs the hook ``options`` ask for on ``model``, on every replica at once.

    Returns the worker thread of clusterflow's own all-reduce algorithms (they form
    process groups, so every replica must call this together), else None.

    Raises:
        ConfigError: clusterflow's algorithm asked for on a backend other than gloo.
    """
    algorithm = options.algorithm
    if algorithm is AllReduceAlgorithm.BACKEND:
        register_compression(model, options.compression, None)
        return None
    check_algorithm(algorithm, str(dist.get_backend()))
    reduce = HierarchicalSum(local_rank, local_world_size, options.timeout_seconds)
    worker = BucketWorker(reduce, dist.get_world_size(), f"clusterflow-{algorithm.value}")
    model.register_comm_hook(worker, bucket_worker_hook)
    return worker

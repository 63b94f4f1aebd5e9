"""The replicas' ``torch.distributed`` process group, formed from a :class:`Membership`.

Users never call ``init_process_group``: the group is formed from what the launcher
injected (or adopted, when the user did form one). Every collective this module runs,
and every error a caller hands to :meth:`CollectiveGroup.translate`, comes out as a
:class:`~clusterflow.collective.api.CollectiveError`; when a peer died or hung, a
:class:`~clusterflow.collective.api.PeerLost` that names its rank and task.

What fails fast, measured on this machine with gloo (torch 2.13, CPU): a SIGKILLed peer
breaks its TCP pairs, and the survivors' next or current collective raises ``Connection
reset by peer`` at once; a SIGSTOPped (hung) peer makes them raise ``Timed out waiting
...ms`` after the group's timeout. Neither names the peer, hence the heartbeats of
:mod:`clusterflow.collective.liveness`.
"""

from __future__ import annotations

import atexit
import datetime
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Final, Literal

import torch
import torch.distributed as dist

# Imported before any group forms, on purpose: torch.distributed.nn binds ``group.WORLD``
# as default arguments when first imported (DDP imports it, through torch._dynamo), so
# imported after init_process_group it would hold that group for good, and its gloo
# threads would live into the interpreter's exit (see CollectiveGroup.shutdown).
import torch.distributed.nn

# The typed home of the store classes; torch.distributed re-exports them untyped.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from clusterflow._checks import listed
from clusterflow.cluster import DeviceSpec
from clusterflow.collective.api import (
    CollectiveError,
    CommunicationImplementation,
    CommunicationOptions,
    MembershipError,
    PeerLost,
)
from clusterflow.collective.liveness import Liveness
from clusterflow.collective.membership import Membership

__all__ = [
    "CollectiveGroup",
    "connect_store",
    "group_prefix",
    "is_collective_failure",
    "select_backend",
    "select_device",
]

_log = logging.getLogger(__name__)

# Words of the errors that gloo, NCCL and c10d raise when a peer or the network fails;
# matched only on exceptions raised while a strategy ran a step, never on user errors
# elsewhere.
_FAILURE_MARKERS: Final = (
    "gloo",
    "nccl",
    "c10d",
    "processgroup",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "socket",
)
# How long a failed collective may wait for a just-killed peer's heartbeat to go stale:
# the liveness stale limit plus two beats.
_DIAGNOSE_WAIT_S: Final = 3.0

ReduceName = Literal["sum", "min", "max"]
_REDUCE_OPS: Final = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def select_backend(implementation: CommunicationImplementation, device: torch.device) -> str:
    """The torch backend for ``implementation`` on ``device``: ``"gloo"`` or ``"nccl"``.

    Raises:
        CollectiveError: NCCL was asked for on a replica without a CUDA device.
    """
    if implementation is CommunicationImplementation.RING:
        return "gloo"
    if implementation is CommunicationImplementation.NCCL:
        if device.type != "cuda":
            raise CollectiveError(
                f"CommunicationImplementation.NCCL needs a CUDA device, but this replica runs "
                f"on {device}; use RING (gloo) or AUTO"
            )
        return "nccl"
    return "nccl" if device.type == "cuda" else "gloo"


def select_device(membership: Membership, devices: Sequence[str] | None = None) -> torch.device:
    """This replica's device: ``devices[local_rank]``, else its GPU, else the CPU.

    One process per device (docs/architecture.md section 5), so the local rank picks it.

    Args:
        devices: TensorFlow device strings (``"/gpu:0"``) or torch ones (``"cuda:1"``),
            one per replica of this host, as ``tf.distribute.MirroredStrategy(devices)``.

    Raises:
        MembershipError: ``devices`` does not list one device per local replica.
    """
    listed("devices", devices, "device names", error=MembershipError)
    if devices:
        if len(devices) != membership.local_world_size:
            raise MembershipError(
                f"{len(devices)} devices given ({', '.join(devices)}) but this host runs "
                f"{membership.local_world_size} replicas (LOCAL_WORLD_SIZE): one process per "
                "device"
            )
        name = devices[membership.local_rank]
        device = torch.device(
            DeviceSpec.parse(name).torch_device() if name.startswith("/") else name
        )
        if device.type == "cuda" and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
        ):
            # Else torch's own AttributeError (a CPU build) or "invalid device ordinal",
            # at set_device, far from the devices given.
            raise MembershipError(
                f"device {name!r} is not on this host ({torch.cuda.device_count()} CUDA "
                "devices visible)"
            )
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", membership.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) is a collective's failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, CollectiveError | dist.DistError):
            return True
        if isinstance(current, RuntimeError):
            text = str(current).lower()
            if any(marker in text for marker in _FAILURE_MARKERS):
                return True
        current = current.__cause__ or current.__context__
    return False


class CollectiveGroup:
    """The replicas of one strategy, with collectives whose errors name lost peers.

    Build with :meth:`form`. A group of one replica has no process group: its collectives
    return their input, so a single process runs the same code as a cluster.
    """

    def __init__(
        self,
        membership: Membership,
        device: torch.device,
        *,
        backend: str | None = None,
        liveness: Liveness | None = None,
        owned: bool = False,
        diagnose_wait_s: float = _DIAGNOSE_WAIT_S,
        store: Store | None = None,
    ) -> None:
        self.membership = membership
        self.store = store
        """The rendezvous store (unprefixed) this group met in; None for one replica or
        an adopted group. A resizing group's next generation meets in it too."""
        self.device = device
        self.backend = backend
        self._liveness = liveness
        self._owned = owned
        self._diagnose_wait_s = diagnose_wait_s

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @classmethod
    def form(
        cls,
        membership: Membership,
        options: CommunicationOptions,
        device: torch.device,
        *,
        store: Store | None = None,
    ) -> CollectiveGroup:
        """Joins (or adopts) the process group of ``membership``'s replicas.

        Blocks until every replica has joined, at most ``rendezvous_timeout_seconds``.
        ``store``: a connection to the rendezvous store to reuse (a resizing group's);
        None connects (or hosts) one. The group meets under ``group_prefix(membership)``.

        Raises:
            MembershipError: an existing process group disagrees with ``membership``, or a
                group of several replicas has no rendezvous address.
            CollectiveError: the store could not be reached or hosted, or not every
                replica joined in time (the message names the missing ranks).
        """
        if dist.is_available() and dist.is_initialized():
            return cls._adopt(membership, options, device)
        if membership.world_size == 1:
            return cls(membership, device, store=store)
        if membership.master_addr is None or membership.master_port is None:
            raise MembershipError(
                f"a world of {membership.world_size} replicas needs a rendezvous address: set "
                "MASTER_ADDR and MASTER_PORT (clusterflow start and torchrun do), or TF_CONFIG"
            )
        backend = select_backend(options.implementation, device)
        if store is None:
            store = connect_store(membership, options.rendezvous_timeout_seconds)
        prefix = group_prefix(membership)
        _join(membership, backend, PrefixStore(prefix, store), options, device)
        liveness = _start_liveness(store, prefix, membership)
        _log.info(
            "formed a %s group of %d replicas; this is %s on %s",
            backend,
            membership.world_size,
            membership.describe(membership.rank),
            device,
        )
        group = cls(membership, device, backend=backend, liveness=liveness, owned=True, store=store)
        # Left before the interpreter finalizes, not at its exit (see shutdown). A strategy
        # that wraps models in DDP registers its own shutdown later, so it runs first.
        atexit.register(group.shutdown)
        return group

    @classmethod
    def _adopt(
        cls, membership: Membership, options: CommunicationOptions, device: torch.device
    ) -> CollectiveGroup:
        rank, world = dist.get_rank(), dist.get_world_size()
        if membership.world_size > 1 and (rank, world) != (membership.rank, membership.world_size):
            raise MembershipError(
                f"the process group already formed is rank {rank} of {world}, but the "
                f"environment says rank {membership.rank} of {membership.world_size}"
            )
        if membership.world_size == 1 and world > 1:
            membership = replace(membership, rank=rank, world_size=world, store_host=None)
        backend = str(dist.get_backend())
        wanted = select_backend(options.implementation, device)
        if wanted != backend:
            _log.warning("using the existing %s process group, not %s", backend, wanted)
        liveness = None
        store = _default_store()
        if store is not None and world > 1:
            liveness = _start_liveness(store, group_prefix(membership), membership)
        _log.info("adopted the existing %s process group: rank %d of %d", backend, rank, world)
        return cls(membership, device, backend=backend, liveness=liveness, owned=False)

    # Collectives ---------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor, op: ReduceName = "sum") -> torch.Tensor:
        """Reduces ``tensor`` in place across the replicas and returns it.

        Raises:
            PeerLost: a replica died or hung (within the group's timeout).
            CollectiveError: the collective failed otherwise.
        """
        if self.world_size > 1:
            with self.guard(f"all-reduce ({op}) of a {tuple(tensor.shape)} tensor"):
                dist.all_reduce(tensor, op=_REDUCE_OPS[op])
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites ``tensor`` with rank ``src``'s; raises as :meth:`all_reduce_`."""
        if self.world_size > 1:
            with self.guard(f"broadcast from rank {src}"):
                dist.broadcast(tensor, src=src)
        return tensor

    def barrier(self) -> None:
        """Waits for every replica; raises as :meth:`all_reduce_`."""
        if self.world_size > 1:
            with self.guard("barrier"):
                dist.barrier()

    # Errors --------------------------------------------------------------------------

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turns a collective's failure inside the block into a typed, named error."""
        try:
            yield
        except CollectiveError:
            raise
        except Exception as exc:
            error = self.translate(exc, what)
            if error is None:
                raise
            raise error from exc

    def translate(self, exc: BaseException, what: str = "a collective") -> CollectiveError | None:
        """The typed error for ``exc``, or None when ``exc`` is not a collective's failure.

        Blocks up to a few seconds, for the heartbeats to tell which peer is gone.
        """
        if self.world_size == 1 or not is_collective_failure(exc):
            return None
        if isinstance(exc, CollectiveError):
            return exc
        cause = _first_line(exc)
        if self._liveness is None:
            return CollectiveError(f"{what} failed (no heartbeats to name the peer): {cause}")
        diagnosis = self._liveness.diagnose(self._diagnose_wait_s)
        me = self.membership.describe(self.rank)
        if diagnosis.lost:
            ranks = diagnosis.lost
            names = ", ".join(
                f"{self.membership.describe(r)}, silent for {s:.1f} s"
                for r, s in zip(ranks, diagnosis.silent_s, strict=True)
            )
            return PeerLost(
                f"lost peer {names}: it died or hung, so {what} on {me} failed: {cause}",
                ranks=ranks,
                tasks=[self.membership.task_of(r) for r in ranks],
            )
        if diagnosis.store_error is not None:
            store = f"{self.membership.master_addr}:{self.membership.master_port}"
            host = self.membership.store_host
            if host is not None and host != self.rank:
                return PeerLost(
                    f"lost peer {self.membership.describe(host)}, which hosts the rendezvous "
                    f"store at {store} (store: {diagnosis.store_error}), so {what} on {me} "
                    f"failed: {cause}",
                    ranks=[host],
                    tasks=[self.membership.task_of(host)],
                )
            return CollectiveError(
                f"the rendezvous store at {store} stopped answering ({diagnosis.store_error}), "
                f"so {what} on {me} failed: {cause}"
            )
        return CollectiveError(f"{what} on {me} failed while every peer still beats: {cause}")

    def shutdown(self) -> None:
        """Stops the heartbeats and leaves the group, if this object formed it.

        Call after dropping every DDP wrapper over the group: the group is freed here,
        from its last reference, and its threads are joined before this returns.

        Why freed here rather than left to the interpreter's exit (torch 2.13, gloo): a
        gloo worker thread drops its reference to a finished collective's tensors after
        the caller went on, and that drop takes the GIL (the tensor's Python object). A
        group alive at exit keeps such threads; one that wakes while Python finalizes is
        ended by CPython with ``pthread_exit``, whose unwinding through torch's
        ``noexcept`` destructor aborts the process ("terminate called without an active
        exception", SIGABRT) after training finished. A group freed from a *Python*
        reference is destroyed with the GIL released, so its threads finish their drops
        and are joined; one freed from C++ (a DDP reducer's reference) would be
        destroyed with the GIL held, and hang on such a thread.
        """
        if self._liveness is not None:
            self._liveness.stop()
            atexit.unregister(self._liveness.stop)
            self._liveness = None
        if self._owned and dist.is_initialized():
            group = dist.group.WORLD
            dist.destroy_process_group()
            del group  # the last reference (see above): the group's threads end here
        self._owned = False
        atexit.unregister(self.shutdown)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def group_prefix(membership: Membership) -> str:
    """The store prefix ``membership``'s group meets under: one per generation, so a
    group re-formed in the same store (a restart, or a resize: ``collective/elastic.py``)
    never reads a key of the group before it."""
    return f"clusterflow/{membership.generation}"


def connect_store(membership: Membership, timeout_s: float) -> TCPStore:
    """A connection to the rendezvous store (hosting it when ``membership`` says so).

    Raises:
        CollectiveError: it could not be reached or hosted within ``timeout_s``.
    """
    assert membership.master_addr is not None and membership.master_port is not None
    where = f"{membership.master_addr}:{membership.master_port}"
    try:
        return TCPStore(
            membership.master_addr,
            membership.master_port,
            membership.world_size if membership.hosts_store else None,
            membership.hosts_store,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as exc:
        verb = "host" if membership.hosts_store else "reach"
        raise CollectiveError(
            f"{membership.describe(membership.rank)} could not {verb} the rendezvous store at "
            f"{where} within {timeout_s:g} s: {_first_line(exc)}"
        ) from exc


def _join(
    membership: Membership,
    backend: str,
    store: Store,
    options: CommunicationOptions,
    device: torch.device,
) -> None:
    store.set(f"joined/{membership.rank}", "1")
    timeout = (
        None
        if options.timeout_seconds is None
        else datetime.timedelta(seconds=options.timeout_seconds)
    )
    extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    try:
        dist.init_process_group(
            backend,
            store=PrefixStore("group", store),
            rank=membership.rank,
            world_size=membership.world_size,
            timeout=timeout,
            **extra,
        )
    except Exception as exc:
        missing = [
            membership.describe(r)
            for r in range(membership.world_size)
            if not _has_key(store, f"joined/{r}")
        ]
        who = f"; missing: {', '.join(missing)}" if missing else ""
        raise CollectiveError(
            f"the {membership.world_size} replicas did not all join within "
            f"{options.rendezvous_timeout_seconds:g} s{who}: {_first_line(exc)}"
        ) from exc


def _has_key(store: Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # the store itself is gone: say nothing rather than guess
        return True


def _default_store() -> Store | None:
    try:
        # Private, but the only way to reach the store of a group the user formed.
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    return store if isinstance(store, Store) else None


def _own_connection(store: Store) -> TCPStore | None:
    """A new client connection to the TCPStore under ``store`` (through its prefixes).

    The heartbeats need their own: beats never queue behind the group's store calls,
    and the connection outlives ``destroy_process_group`` (a beat on a destroyed group's
    store aborts the process).
    """
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    clone = getattr(store, "clone", None) if isinstance(store, TCPStore) else None
    if clone is None:
        return None
    own: TCPStore = clone()
    # Short, so a hung store host shows as a store error rather than a stalled beat.
    own.set_timeout(datetime.timedelta(seconds=2))
    return own


def _start_liveness(store: Store, prefix: str, membership: Membership) -> Liveness | None:
    try:
        own = _own_connection(store)
        if own is None:
            _log.warning("the group's store is not a TCPStore: a lost peer will not be named")
            return None
        liveness = Liveness(
            PrefixStore(f"{prefix}/liveness", own), membership.rank, membership.world_size
        )
        liveness.start()
    except Exception as exc:
        _log.warning("no heartbeats, so a lost peer will not be named: %s", exc)
        return None
    # Stopped before the interpreter tears down, not killed mid-call as a daemon thread.
    atexit.register(liveness.stop)
    return liveness

"""``python -m pycomm.parallel.pathways.worker``: one long-lived rank of an island.

It joins its island's process group (pycomm: shared memory among the island's ranks),
links to every worker of the other islands (gloo pairs), says hello to its island's
scheduler, and then runs what the scheduler sends, in the scheduler's order: nodes (one
function call on one of its meshes each), sends of its objects to other workers, fetches
by a controller, releases. Settings come in the environment (``PW_*``, set by the
launcher), so that the built-in launcher and Ray's start the very same worker.

Two threads besides the data plane's: this one runs nodes, one at a time, in order; the
control thread reads the scheduler's messages and, for every node as it arrives, posts
the receives of its inputs at once: that is what dispatching a graph whole buys.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .functions import unwrapped
from .mesh_context import GroupPool, MeshContext, MeshGroups
from .objects import ObjectError, Objects
from .protocol import Lit, Local, Node, Recv, connect, put, take
from .startup import leave_cause, wait_launched
from .transfer import Links, PendingRecv, Transfers


@dataclass(frozen=True)
class Settings:
    """A worker's place and its cluster's addresses, from ``PW_*`` variables."""

    island: int
    rank: int
    sizes: list[int]
    epochs: list[int]
    store: tuple[str, int]
    scheduler: tuple[str, int]
    authkey: bytes
    timeout_s: float
    threads: int

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
        def address(name: str) -> tuple[str, int]:
            host, _, port = env[name].rpartition(":")
            return host, int(port)
        return cls(island=int(env["PW_ISLAND"]), rank=int(env["PW_RANK"]),
                   sizes=[int(s) for s in env["PW_SIZES"].split(",")],
                   epochs=[int(e) for e in env["PW_EPOCHS"].split(",")],
                   store=address("PW_STORE"), scheduler=address("PW_SCHEDULER"),
                   authkey=bytes.fromhex(env["PW_AUTHKEY"]),
                   timeout_s=float(env.get("PW_TIMEOUT_S", "300")),
                   threads=int(env.get("PW_THREADS", "1")))

    @property
    def size(self) -> int:
        return self.sizes[self.island]


class Worker:
    """One rank: its meshes, its objects, and the loop that runs its nodes."""

    def __init__(self, settings: Settings, store: dist.Store):
        self.s = settings
        self.where = (settings.island, settings.rank)
        self.objects = Objects()
        self.meshes: dict[int, MeshContext] = {}  # the meshes this worker is in
        self.mesh_groups: dict[int, MeshGroups] = {}  # every mesh of the island
        self.unmade: dict[int, str] = {}  # meshes whose groups failed here, and why
        self._functions: dict[bytes, Any] = {}
        self.pool = GroupPool()
        self._nodes: queue.SimpleQueue[tuple[Node, dict[int, PendingRecv]] | None] = (
            queue.SimpleQueue())
        self._send_lock = threading.Lock()
        wait_launched(store, settings.island, settings.epochs[settings.island],
                      settings.timeout_s)
        self._join_island(store)
        links = Links(store, self.where, settings.sizes, settings.epochs, settings.timeout_s)
        self.transfers = Transfers(self.where, self.objects, links)
        built = threading.Event()

        def build_links() -> None:
            links.build(list(range(len(settings.sizes))))
            built.set()
        self.transfers.submit(build_links)
        if not built.wait(settings.timeout_s):
            raise TimeoutError(f"island {settings.island} rank {settings.rank}: the links to "
                               f"the other islands' workers were not made in "
                               f"{settings.timeout_s:g} s")
        self.links = links
        self.conn = connect(settings.scheduler, settings.authkey)
        self.tell("hello", settings.rank, os.getpid())

    def _join_island(self, store: dist.Store) -> None:
        import pycomm  # noqa: F401  (registers the backend)
        s = self.s
        prefix = dist.PrefixStore(f"pw/island{s.island}/e{s.epochs[s.island]}/", store)
        dist.init_process_group("pycomm", store=prefix, rank=s.rank, world_size=s.size,
                                timeout=datetime.timedelta(seconds=s.timeout_s))
        torch.set_num_threads(s.threads)

    def tell(self, *message: Any) -> None:
        with self._send_lock:
            put(self.conn, message)

    # -- the control thread
    def control(self) -> None:
        try:
            while True:
                message = take(self.conn)
                try:
                    if not self._handle(message):
                        break
                except Exception as e:  # one bad message must not stop the worker
                    print(f"pathways island {self.s.island} rank {self.s.rank}: dropped "
                          f"{str(message)[:120]}: {type(e).__name__}: {e}", file=sys.stderr)
        except (EOFError, OSError):
            pass  # the scheduler is gone: nothing more will come
        self._nodes.put(None)

    def _handle(self, message: tuple[Any, ...]) -> bool:
        what = message[0]
        if what == "run":
            node: Node = message[1]
            self._nodes.put((node, self._post_receives(node)))
        elif what == "send":
            self.transfers.send_when_ready(message[1])
        elif what == "fetch":
            _, client, request, key = message
            self.objects.when_ready(key, lambda value, error: self._reply(
                client, request, value, error))
        elif what == "forget_client":
            self.objects.release_client(message[1])
        elif what == "release":
            self.objects.release(message[1])
        elif what == "relink":
            _, island, epoch = message
            self.transfers.submit(lambda: self.links.renew(island, epoch))
        elif what == "stop":
            return False
        return True

    def _reply(self, client: int, request: int, value: Any, error: str | None) -> None:
        try:
            self.tell("value", client, request, value, error)
        except Exception as e:  # the value does not pickle: say so instead
            self.tell("value", client, request, None,
                      f"island {self.s.island} rank {self.s.rank}: the value cannot be sent "
                      f"to the controller: {type(e).__name__}: {e}")

    def _post_receives(self, node: Node) -> dict[int, PendingRecv]:
        if node.kind != "call":
            return {}
        args = node.args[node.ranks.index(self.s.rank)]
        return {i: self.transfers.expect(a) for i, a in enumerate(args) if isinstance(a, Recv)}

    # -- this thread
    def run(self) -> None:
        threading.Thread(target=self.control, name="pw-control", daemon=True).start()
        while (item := self._nodes.get()) is not None:
            self._run_node(*item)
        self.transfers.stop()

    def _run_node(self, node: Node, pending: dict[int, PendingRecv]) -> None:
        start = time.monotonic()
        try:
            outputs = self._call(node, pending)
        except Exception as e:
            cause = e.__cause__ if isinstance(e, _FunctionRaised) else e
            error = self._describe(node, cause or e)
            for key in node.output_keys():
                self.objects.fail(key, error)
            # Told before the abort, so that the cause reaches the scheduler ahead of the
            # abort's echoes from the other ranks.
            self.tell("failed", node.client, node.node, self.s.rank, error)
            if isinstance(e, _FunctionRaised):
                self._abort_mesh(node, error)
            return
        for key, value in zip(node.output_keys(), outputs, strict=True):
            self.objects.put(key, value)
        self.tell("done", node.client, node.node, self.s.rank, start, time.monotonic())

    def _call(self, node: Node, pending: dict[int, PendingRecv]) -> list[Any]:
        if node.kind == "mesh":  # on every worker of the island
            ranks, shape, names = (a.value for a in node.args[0])  # type: ignore[union-attr]
            try:  # collective over the island: a worker still busy elsewhere fails it
                groups = self.mesh_groups[node.mesh] = MeshGroups(self.pool, ranks, shape)
            except Exception as e:
                self.unmade[node.mesh] = f"{type(e).__name__}: {_quoted(str(e))}"
                raise
            if self.s.rank in ranks:
                self.meshes[node.mesh] = MeshContext(self.s.island, groups, names)
            return [None]
        if node.kind == "drop":
            self.meshes.pop(node.mesh, None)
            if self.unmade.pop(node.mesh, None) is not None:  # no groups to give back
                return [None]
            self.mesh_groups.pop(node.mesh).release(reuse=bool(node.args[0][0].value))  # type: ignore[union-attr]
            return [None]
        ctx = self.meshes.get(node.mesh)
        if ctx is None and node.mesh in self.unmade:
            raise RuntimeError(f"mesh {node.mesh} of island {self.s.island} could not be made "
                               f"(every worker of the island makes its groups, and one did not "
                               f"come: still running an earlier node?): "
                               f"{self.unmade[node.mesh]}; ask for a new mesh")
        if ctx is None:
            raise LookupError(f"mesh {node.mesh} is not on this worker (released?)")
        if ctx.broken:
            raise RuntimeError(ctx.broken)
        fn = self._function(node.fn)
        args = self._inputs(ctx, node, node.args[ctx.index], pending)
        kwargs = {k: self._resolve(a, None) for k, a in node.kwargs.items()}
        try:
            result = fn(ctx, *args, **kwargs)
        except Exception as e:
            raise _FunctionRaised() from e
        return _outputs(node, result)

    def _function(self, blob: bytes | None) -> Any:
        """The node's function (unpickled here, so that one the worker cannot import
        fails its node, naming why, instead of the message that carried it)."""
        assert blob is not None
        fn = self._functions.get(blob)
        if fn is None:
            fn = self._functions[blob] = unwrapped(pickle.loads(blob))
        return fn

    def _abort_mesh(self, node: Node, error: str) -> None:
        """A function raised here: the other ranks may be waiting in its collectives, or
        would pair this rank's next collective with one of this function's. Abort the
        mesh's groups (the others' waits end now, with the abort's message) and refuse
        the mesh from now on, as NCCL's users abort a communicator after an error."""
        ctx = self.meshes[node.mesh]
        if ctx.size() > 1 and not ctx.broken:
            ctx.broken = (f"mesh {node.mesh} of island {self.s.island} was aborted after "
                          f"node {node.node} failed ({_quoted(error)}); ask for a new mesh")
            ctx.abort()

    def _inputs(self, ctx: MeshContext, node: Node, args: list[Any],
                pending: dict[int, PendingRecv]) -> list[Any]:
        """The node's arguments here. If an input failed on any rank of the mesh, no rank
        runs the function: one running alone would wait in its collectives for ranks
        that never come. The ranks agree with one small all-reduce when the node has
        inputs that can fail (futures), which every rank knows alike; a client that
        turned this off (``check_inputs=False``) saves that all-reduce, and a rank then
        waits out the timeout behind a rank whose input failed."""
        values, failure = [], None
        for i, arg in enumerate(args):
            try:
                values.append(self._resolve(arg, pending.get(i)))
            except Exception as e:  # a failed input, a transfer's timeout, a bad pickle
                failure = failure or (e if isinstance(e, ObjectError) else ObjectError(
                    f"argument {i}: {type(e).__name__}: {e}"))
        if node.agree and ctx.size() > 1 and any(not isinstance(a, Lit) for a in args):
            flag = torch.tensor([ctx.index + 1 if failure else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group())
            if failure is None and int(flag):
                raise ObjectError(f"an input of mesh position {int(flag) - 1} failed")
        if failure is not None:
            raise failure
        return values

    def _resolve(self, arg: Any, pending: PendingRecv | None) -> Any:
        if isinstance(arg, Lit):
            return arg.value
        if isinstance(arg, Local):
            return self.objects.get(arg.key, self.s.timeout_s)
        assert pending is not None
        return pending.value(self.s.timeout_s)

    def _describe(self, node: Node, e: BaseException) -> str:
        where = f"island {self.s.island} rank {self.s.rank}"
        what = f"{node.label or node.kind} (node {node.node} of client {node.client})"
        if isinstance(e, ObjectError):
            return f"{where}: {what}: an input failed: {e}"
        frames = traceback.extract_tb(e.__traceback__)
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        return f"{where}: {what} raised {type(e).__name__}: {e}{at}"


def _quoted(error: str, limit: int = 300) -> str:
    """``error`` within ``limit`` characters, its head and its tail: the scheduler reads
    the tail (what pycomm says of a peer, before the location) to tell an abort's echo."""
    if len(error) <= limit:
        return error
    return f"{error[:limit // 2]} ... {error[-(limit // 2):]}"


class _FunctionRaised(Exception):
    """The node's own function raised (its cause): not an input, not an output check."""


def _outputs(node: Node, result: Any) -> list[Any]:
    """The function's return split into the node's outputs, each checked against its spec."""
    values = [result] if node.n_out == 1 else result
    if node.n_out > 1 and (not isinstance(values, tuple | list) or len(values) != node.n_out):
        raise TypeError(f"{node.label} was declared with {node.n_out} outputs but returned "
                        f"{type(result).__name__}"
                        + (f" of {len(values)}" if isinstance(values, tuple | list) else ""))
    for k, (value, spec) in enumerate(zip(values, node.specs, strict=True)):
        if spec is not None and not spec.matches(value):
            got = (f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise TypeError(f"{node.label} output {k}: declared {spec}, returned {got}")
    return list(values)


def _exit_after_a_failed_start(settings: Settings, store: dist.Store,
                               error: BaseException) -> NoReturn:
    """Leave the cause for the cluster, free the island's group, and exit now: a link
    may still be in the making on the transfers thread (a timed-out wait), and letting
    the interpreter finalise under it aborts the process (status -6) instead of 1."""
    leave_cause(store, settings.island, settings.rank, settings.epochs[settings.island],
                error)
    traceback.print_exception(error)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(1)


def main() -> None:
    settings = Settings.from_env()
    store = dist.TCPStore(*settings.store, is_master=False,
                          timeout=datetime.timedelta(seconds=settings.timeout_s))
    try:
        worker = Worker(settings, store)
    except BaseException as e:
        _exit_after_a_failed_start(settings, store, e)
    try:
        worker.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        worker.conn.close()


if __name__ == "__main__":
    main()

"""The worker's side: ``KVWorker`` pushes and pulls (key, value-vector) pairs.

Requests are asynchronous, as the paper's: ``push``/``pull`` return a timestamp at once
and ``wait(ts)`` blocks until that request is done. A request is split by the ring into
one part per server; a part that a dead server will never answer, or that a server
refuses as sent under an older ring, is sent again under the new ring (a push twice is
applied once: servers remember each key's last push per worker).
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._optional import missing

try:
    import zmq
except ModuleNotFoundError as err:
    raise missing("zmq", "pycomm.parallel.ps (the parameter server's ZeroMQ transport)",
                  err) from err

from . import wire
from .config import JobConfig
from .filters import encode
from .node import Heartbeat, dealer, send
from .ring import Ring
from .store import TableSpec

DENSE_BLOCK = 4096  # elements per key of a dense tensor: one key is one block
DONE_ACK_S = 5.0  # how long close() waits for the scheduler to count this worker done


class PSError(RuntimeError):
    """A server or the scheduler refused a request, or did not answer in time."""


@dataclass
class Request:
    op: str  # push, set or pull
    table: str
    keys: torch.Tensor
    values: torch.Tensor | None  # push/set: (n, dim); pull: the output
    clock: int
    seq: int
    codec: str = "none"
    parts: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # id -> (sid, mask)
    error: str = ""


class KVWorker:
    """This process's connection to the parameter servers (from the environment that
    ``python -m pycomm.parallel.ps.launch`` or the user sets: see pycomm.parallel.ps.config)."""

    def __init__(self, rank: int | None = None, cfg: JobConfig | None = None):
        self.cfg = cfg or JobConfig.from_env()
        self.rank = int(os.environ.get("PS_RANK", "0")) if rank is None else rank
        self.num_workers = self.cfg.workers
        self.ctx = zmq.Context()
        self.sched = dealer(self.ctx, self.cfg.scheduler, f"w{self.rank}-control")
        send(self.sched, {"op": "register", "role": "worker", "rank": self.rank,
                          "pid": os.getpid()})
        self.heartbeat = Heartbeat(self.ctx, self.cfg.scheduler, f"worker{self.rank}")
        self.servers: dict[int, zmq.Socket] = {}
        self.endpoints: dict[int, str] = {}
        self.ring: Ring | None = None
        self.epoch = -1
        self.clock_value = 0
        self.seq = 0
        self.requests: dict[int, Request] = {}
        self.part_of: dict[int, int] = {}  # part id -> request ts
        self.next_id = 0
        self.dims: dict[str, int] = {}
        self.pushed_bytes = self.pulled_bytes = 0
        self.dead_workers: list[int] = []
        self.control: dict[int, dict[str, Any]] = {}
        self._barrier_id = -1
        self.replacement = False
        self.stats_replies: dict[int, dict[str, Any]] = {}
        self._await_control(lambda: self.ring is not None, "the job to start")
        if self.replacement:  # go on from the step the dead worker did not finish
            reply = self._stats_of(min(self.servers))
            self.clock_value = int(reply["vc"][str(self.rank)])
        self._closed = False
        # A script that ends without close() has finished all the same: say so, or the
        # scheduler would report this worker dead once its process is gone.
        atexit.register(self.close)

    # -- tables ------------------------------------------------------------------------------

    def declare(self, table: str, dim: int, updater: str | dict[str, Any] = "sgd",
                init: str = "zeros") -> None:
        """Make ``table`` (value vectors of ``dim`` floats, updated by ``updater``: a
        name or a spec such as ``{"name": "adam", "lr": 1e-3}``) on every server. Every
        worker may declare it; the declarations must agree."""
        from .updaters import make_updater

        spec = TableSpec(table, int(dim), make_updater(updater).spec(), init)
        TableSpec.from_dict(spec.as_dict())  # validates
        ids = [self._send_to(sid, {"op": "declare", "table": spec.as_dict()})
               for sid in self.servers]
        self._await_replies(ids, f"declare {table!r}")
        self.dims[table] = spec.dim

    # -- push and pull ---------------------------------------------------------------------

    def push(self, keys: torch.Tensor, values: torch.Tensor, table: str = "default",
             codec: str = "none") -> int:
        """Send ``values`` ((len(keys), dim), or flat) for ``keys`` (sorted unique int64)
        to the servers, which apply the table's update rule. ``codec`` compresses the
        values on the wire (pycomm.parallel.ps.filters: fp16, bf16, int8 with a scale per
        block). Returns a timestamp."""
        return self._submit("push", table, keys, values, codec)

    def set(self, keys: torch.Tensor, values: torch.Tensor, table: str = "default") -> int:
        """Assign ``values`` to ``keys`` (initial values: no update rule)."""
        return self._submit("set", table, keys, values)

    def pull(self, keys: torch.Tensor, out: torch.Tensor | None = None,
             table: str = "default") -> int:
        """Ask for the values of ``keys``; they land in ``out`` ((len(keys), dim);
        allocated if None: :meth:`result`) once :meth:`wait` returns."""
        dim = self._dim(table)
        keys = self._checked_keys(keys, table)
        if out is None:
            out = torch.empty(len(keys), dim)
        elif out.dtype != torch.float32 or out.numel() != len(keys) * dim:
            raise ValueError(f"pull {table!r}: out must be float32 with {len(keys)} x {dim} "
                             f"elements, got {out.dtype} {list(out.shape)}")
        return self._submit("pull", table, keys, out.view(len(keys), dim))

    def wait(self, ts: int) -> None:
        """Block until request ``ts`` is done; raises PSError if it failed."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while self.requests[ts].parts:
            if time.monotonic() > deadline:
                req = self.requests[ts]
                sids = sorted({sid for sid, _ in req.parts.values()})
                raise PSError(f"worker {self.rank}: {req.op} {req.table!r} (ts {ts}): no "
                              f"answer from server(s) {sids} in {self.cfg.timeout_s:.0f} s")
            self._poll(100)
        req = self.requests.pop(ts)
        if req.error:
            raise PSError(req.error)

    def result(self, ts: int) -> torch.Tensor:
        """A pull's values (waits for it)."""
        out = self.requests[ts].values
        self.wait(ts)
        assert out is not None
        return out

    def clock(self) -> int:
        """End this worker's step: wait for its pushes, then tell every server (they
        answer the next step's pulls as the consistency model allows)."""
        for ts in [t for t, r in self.requests.items() if r.op in ("push", "set")]:
            self.wait(ts)
        self.clock_value += 1
        for sid in list(self.servers):
            self._send_to(sid, {"op": "clock", "worker": self.rank, "clock": self.clock_value})
        return self.clock_value

    # -- dense tensors by name ------------------------------------------------------------

    def declare_dense(self, named: Mapping[str, torch.Tensor],
                      updater: str | dict[str, Any] = "sgd", block: int = DENSE_BLOCK) -> None:
        """One table per tensor (its name), cut into blocks of ``block`` elements (a key
        each, spread over the servers); worker 0 sets the initial values, every worker
        waits for them."""
        for name, t in named.items():
            self.declare(name, min(block, max(t.numel(), 1)), updater, init="none")
        if self.rank == 0:
            for ts in [self.set(*self._blocks(name, t), table=name) for name, t in named.items()]:
                self.wait(ts)
        self.barrier()

    def push_dense(self, named: Mapping[str, torch.Tensor], codec: str = "none") -> list[int]:
        """Push every tensor of ``named`` (its table: its name); returns the timestamps."""
        return [self.push(*self._blocks(name, t), table=name, codec=codec)
                for name, t in named.items()]

    def pull_dense(self, named: Mapping[str, torch.Tensor]) -> None:
        """Pull every tensor of ``named`` into it (in place; a model's own parameters,
        which require grad, included: the copy is not part of any graph)."""
        waits = []
        for name, t in named.items():
            keys, blocks = self._blocks(name, t)
            waits.append((self.pull(keys, out=blocks, table=name), name, t, blocks))
        for ts, _, t, blocks in waits:
            self.wait(ts)
            with torch.no_grad():
                t.copy_(blocks.view(-1)[: t.numel()].view(t.shape))

    def _blocks(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self._dim(name)
        n = -(-t.numel() // dim)
        padded = torch.zeros(n * dim)
        padded[: t.numel()] = t.detach().reshape(-1).float()
        return torch.arange(n, dtype=torch.int64), padded.view(n, dim)

    # -- job control -------------------------------------------------------------------------

    def barrier(self) -> None:
        rid = self._barrier_id = self._control({"op": "barrier", "worker": self.rank})
        self._await_control(lambda: rid in self.control, "the barrier")
        self.control.pop(rid)

    def checkpoint(self, path: str) -> None:
        """Every server writes the rows it leads to ``path``, then the scheduler writes
        ``job.pt`` with this worker's clock (call it from one worker between steps, after
        a :meth:`barrier`). ``launch --restore path`` starts a job from it: the workers'
        :attr:`clock_value` is the step to go on from."""
        self._control_call({"op": "checkpoint", "path": os.path.abspath(path),
                            "clock": self.clock_value}, "checkpoint")

    def add_server(self) -> None:
        """Start one more server; it joins the ring and takes its ranges over."""
        self._control_call({"op": "add_server"}, "add_server")

    def stats(self) -> dict[str, Any]:
        """The job's counts: pushes applied (each key's count, summed), the events."""
        return self._control_call({"op": "stats"}, "stats")

    def _stats_of(self, sid: int) -> dict[str, Any]:
        """One server's counts and vector clock."""
        rid = self._send_to(sid, {"op": "stats"})
        self.requests[rid] = Request("stats", "", torch.empty(0, dtype=torch.int64), None, 0, 0,
                                     parts={rid: (-1, torch.empty(0))})
        self.part_of[rid] = rid
        got: dict[str, Any] = {}
        self.stats_replies[rid] = got
        self.wait(rid)
        return got

    def close(self) -> None:
        """Tell the scheduler this worker is done (the job ends when all are). Called
        again, or at the interpreter's exit after a call, it does nothing."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        rid = self._control({"op": "done", "worker": self.rank})
        # Acknowledged, so the scheduler has counted this worker done before its process
        # exits (else the launcher may see every worker gone first and end the job as
        # failed); a scheduler that does not answer in DONE_ACK_S is gone already.
        deadline = time.monotonic() + min(DONE_ACK_S, self.cfg.timeout_s)
        while rid not in self.control and time.monotonic() < deadline:
            self._poll(50)
        self.heartbeat.stop()
        for sock in [self.sched, *self.servers.values()]:
            sock.close(linger=500)
        self.ctx.term()

    def __enter__(self) -> KVWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _dim(self, table: str) -> int:
        if table not in self.dims:
            raise ValueError(f"table {table!r} was not declared by this worker "
                             f"(kv.declare(table, dim, ...) first)")
        return self.dims[table]

    def _checked_keys(self, keys: torch.Tensor, table: str) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            raise ValueError(f"{table!r}: keys must be a 1-D int64 tensor, got "
                             f"{getattr(keys, 'dtype', type(keys))} "
                             f"{list(getattr(keys, 'shape', []))}")
        if len(keys) > 1:
            bad = (keys[1:] <= keys[:-1]).nonzero()
            if len(bad):
                i = int(bad[0])
                what = "duplicate" if keys[i] == keys[i + 1] else "unsorted"
                raise ValueError(f"{table!r}: keys must be sorted and unique: {what} at "
                                 f"index {i + 1} ({int(keys[i])} then {int(keys[i + 1])})")
        return keys

    def _submit(self, op: str, table: str, keys: torch.Tensor, values: torch.Tensor,
                codec: str = "none") -> int:
        dim = self._dim(table)
        keys = self._checked_keys(keys, table)
        if op != "pull":
            if values.numel() != len(keys) * dim:
                raise ValueError(f"{op} {table!r}: {len(keys)} keys x dim {dim} = "
                                 f"{len(keys) * dim} values expected, got "
                                 f"{values.numel()} (shape {list(values.shape)})")
            values = values.detach().float().reshape(len(keys), dim)
            self.seq += 1
        ts = self._new_id()
        self.requests[ts] = Request(op, table, keys, values, self.clock_value, self.seq, codec)
        self._send_parts(ts, torch.ones(len(keys), dtype=torch.bool))
        return ts

    def _send_parts(self, ts: int, mask: torch.Tensor) -> None:
        """Send the keys of ``mask`` to their primaries under the current ring."""
        req = self.requests[ts]
        assert self.ring is not None
        if not bool(mask.any()):
            return
        primary = self.ring.primary(req.table, req.keys)
        for sid in primary[mask].unique().tolist():
            part = mask & (primary == sid)
            header = {"op": req.op, "table": req.table, "worker": self.rank, "seq": req.seq,
                      "clock": req.clock}
            tensors = [req.keys[part]]
            if req.op != "pull":
                assert req.values is not None
                if req.codec != "none":
                    frames, meta = encode(req.values[part].contiguous(), req.codec)
                    header["codec"] = meta
                    tensors += [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in frames]
                else:
                    tensors.append(req.values[part])
                self.pushed_bytes += sum(t.numel() * t.element_size() for t in tensors)
            pid = self._send_to(sid, header, tensors)
            req.parts[pid] = (sid, part)
            self.part_of[pid] = ts

    def _send_to(self, sid: int, header: dict[str, Any], tensors: list[torch.Tensor] | tuple = ()
                 ) -> int:
        rid = self._new_id()
        send(self.servers[sid], {**header, "id": rid, "epoch": self.epoch}, tensors)
        return rid

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _await_replies(self, ids: list[int], what: str) -> None:
        """Wait for plain replies (declare) to the request ids."""
        for rid in ids:
            self.requests[rid] = Request("declare", what, torch.empty(0, dtype=torch.int64),
                                         None, 0, 0, parts={rid: (-1, torch.empty(0))})
            self.part_of[rid] = rid
        for rid in ids:
            self.wait(rid)

    def _control(self, header: dict[str, Any]) -> int:
        rid = self._new_id()
        send(self.sched, {**header, "id": rid})
        return rid

    def _control_call(self, header: dict[str, Any], what: str) -> dict[str, Any]:
        rid = self._control(header)
        self._await_control(lambda: rid in self.control, what)
        reply = self.control.pop(rid)
        if reply["op"] == "error":
            raise PSError(f"worker {self.rank}: {what}: {reply['message']}")
        return reply

    def _await_control(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise PSError(f"worker {self.rank}: no answer from the scheduler at "
                              f"{self.cfg.scheduler} for {what} in {self.cfg.timeout_s:.0f} s")
            self._poll(100)

    def _poll(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        poller.register(self.sched, zmq.POLLIN)
        for sock in self.servers.values():
            poller.register(sock, zmq.POLLIN)
        for sock, _ in poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                header, tensors = wire.unpack(frames)
                if sock is self.sched:
                    self._on_control(header)
                else:
                    self._on_reply(header, tensors)

    def _on_control(self, header: dict[str, Any]) -> None:
        op = header["op"]
        if op in ("start", "ring"):
            self._set_ring(header)
        elif op == "worker_dead":
            self.dead_workers.append(int(header["worker"]))
        elif op == "barrier_done":
            self.control[self._barrier_id] = header
        elif "id" in header and header["id"] is not None:
            self.control[int(header["id"])] = header
        elif op == "error":
            raise PSError(f"worker {self.rank}: scheduler: {header.get('message')}")

    def _set_ring(self, header: dict[str, Any]) -> None:
        self.endpoints = {int(k): v for k, v in header["endpoints"].items()}
        for sid in list(self.servers):
            if sid not in self.endpoints:
                self.servers.pop(sid).close(linger=0)
        joined = [sid for sid in self.endpoints if sid not in self.servers]
        for sid in joined:
            self.servers[sid] = dealer(self.ctx, self.endpoints[sid], f"w{self.rank}")
        self.ring, self.epoch = Ring.from_spec(header["ring"]), int(header["epoch"])
        if header["op"] == "start":
            self.clock_value = int(header.get("clock", 0))  # > 0 when restored
            self.replacement = bool(header.get("replacement"))
        for sid in joined if header["op"] == "ring" else []:  # a new server learns our clock
            self._send_to(sid, {"op": "clock", "worker": self.rank, "clock": self.clock_value})
        # Parts sent to servers that left are sent again under the new ring.
        for pid in [p for p, ts in self.part_of.items()
                    if self.requests.get(ts) and self.requests[ts].parts.get(p, (None,))[0]
                    not in self.endpoints and self.requests[ts].parts[p][0] != -1]:
            self._resend(pid)

    def _resend(self, pid: int) -> None:
        ts = self.part_of.pop(pid)
        req = self.requests[ts]
        _, mask = req.parts.pop(pid)
        self._send_parts(ts, mask)

    def _on_reply(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        pid = int(header.get("id") or -1)
        if pid not in self.part_of:
            if header["op"] == "error":
                raise PSError(f"worker {self.rank}: {header.get('message')}")
            return  # an answer to a part already sent again elsewhere
        ts = self.part_of[pid]
        req = self.requests[ts]
        op = header["op"]
        if op == "stale":
            if int(header["epoch"]) > self.epoch:
                self._await_control(lambda: self.epoch >= int(header["epoch"]),
                                    f"ring epoch {header['epoch']}")
            self._resend(pid)
            return
        self.part_of.pop(pid)
        _, mask = req.parts.pop(pid)
        if op == "stats" and pid in self.stats_replies:
            self.stats_replies.pop(pid).update(header)
        elif op == "error":
            req.error = req.error or str(header.get("message"))
        elif op == "values":
            assert req.values is not None
            req.values[mask] = tensors[0]
            self.pulled_bytes += tensors[0].numel() * 4 + int(mask.sum()) * 8

"""A parameter server's update rules: torch's optimizers applied per key to the rows a push touched.

A server holds, per table, ``values`` (N, d) float32 and the state tensors its updater names
(N, cols), all zero at first. A push brings gradients for some rows; ``apply`` updates those
rows as if every key had its own torch optimizer that steps only when the key is pushed (Li
et al., OSDI 2014, §3: updates are sparse). So step counts, momentum buffers and Adagrad's
initial accumulator are per key, and a key's first push is its step 1.

The element-wise sums and products run in pycomm's C++ reduction kernels
(``_reduce_into``: dst = a + b or a * b over contiguous float32 blocks). They take no
scalar, so a scalar multiply, division, sqrt and lerp stay in torch.

Example::

    u = make_updater({"name": "adam", "lr": 1e-2})
    state = u.init_state(values.shape[0], values.shape[1])
    u.apply(values, state, torch.tensor([0, 3]), grads)  # grads (2, d)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from types import ModuleType
from typing import Any, ClassVar

import torch

Tensor = torch.Tensor


@functools.cache
def _kernels() -> ModuleType:
    """pycomm._C, loaded on first use: importing this module needs no build."""
    from pycomm._extension import load as _extension

    return _extension()


def _add(dst: Tensor, a: Tensor, b: Tensor) -> None:
    """dst = a + b (contiguous float32 of one size; dst may be a or b)."""
    _kernels()._reduce_into(dst, a, b, "sum")


def _square(g: Tensor) -> Tensor:
    """g * g through the kernels' product."""
    out = torch.empty_like(g)
    _kernels()._reduce_into(out, g, g, "prod")
    return out


def _with_weight_decay(w: Tensor, g: Tensor, weight_decay: float) -> Tensor:
    """g + weight_decay * w (torch's coupled L2 term), as a new tensor: g is the caller's."""
    if weight_decay == 0:
        return g
    out = w * weight_decay  # a scalar multiply: no kernel takes a scalar
    _add(out, out, g)
    return out


class _Rows:
    """The rows one update touches: a view when they are one run, else a gathered copy.

    Rows are sorted and unique, so they form a run exactly when last - first + 1 == n; a
    push of a key range (the common case) then updates the table in place, no copy.
    """

    def __init__(self, rows: Tensor) -> None:
        n = rows.numel()
        self.rows = rows
        self.start = int(rows[0]) if n else 0
        self.stop = self.start + n
        self.is_run = n > 0 and int(rows[-1]) + 1 == self.stop

    def gather(self, t: Tensor) -> Tensor:
        return t[self.start : self.stop] if self.is_run else t.index_select(0, self.rows)

    def scatter(self, t: Tensor, block: Tensor) -> None:
        if not self.is_run:  # a view was updated in place already
            t.index_copy_(0, self.rows, block)


def _check_rows(rows: Tensor, n_rows: int) -> None:
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"rows must be a 1-D int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() == 0:
        return
    bad = rows[(rows < 0) | (rows >= n_rows)]
    if bad.numel():
        raise ValueError(f"row {int(bad[0])} is out of range for a table of N={n_rows} rows")
    unordered = (rows[1:] <= rows[:-1]).nonzero()
    if unordered.numel():
        i = int(unordered[0]) + 1
        raise ValueError(f"rows must be sorted and unique: rows[{i}]={int(rows[i])} follows "
                         f"rows[{i - 1}]={int(rows[i - 1])}")


def _check_tensors(values: Tensor, state: dict[str, Tensor], grads: Tensor, n: int,
                   columns: dict[str, int]) -> None:
    if values.dtype != torch.float32 or values.dim() != 2 or not values.is_contiguous():
        raise ValueError(f"values must be a contiguous (N, d) float32 tensor, got {values.dtype} "
                         f"{tuple(values.shape)}")
    n_rows, dim = values.shape
    if grads.dtype != torch.float32 or tuple(grads.shape) != (n, dim):
        raise ValueError(f"grads must be float32 of shape {(n, dim)} (rows, d), got "
                         f"{grads.dtype} {tuple(grads.shape)}")
    for name, cols in columns.items():
        t = state.get(name)
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != (n_rows, cols) \
                or not t.is_contiguous():
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"state[{name!r}] must be contiguous float32 of shape "
                             f"{(n_rows, cols)}, got {got}")


class Updater:
    """A table's update rule. Subclasses: Sgd, Adagrad, Adam, Ftrl, CallableUpdater."""

    name: ClassVar[str]

    def state_columns(self, dim: int) -> dict[str, int]:
        """The state tensors the rule needs, name -> columns (dim, or 1 for a per-key count)."""
        raise NotImplementedError

    def init_state(self, n_rows: int, dim: int) -> dict[str, Tensor]:
        """Zeroed state for n_rows keys: every rule starts a key's state at zero."""
        return {k: torch.zeros(n_rows, c) for k, c in self.state_columns(dim).items()}

    def apply(self, values: Tensor, state: dict[str, Tensor], rows: Tensor, grads: Tensor) -> None:
        """Update values[rows] and state[*][rows] in place from grads; other rows untouched.

        Args:
            values: (N, d) contiguous float32.
            state: name -> (N, cols) contiguous float32, as :meth:`state_columns` says.
            rows: int64 (n,), sorted unique local row indices.
            grads: (n, d) float32, the (already summed or averaged) gradient of those rows.

        Raises:
            ValueError: a dtype or shape is wrong (naming both shapes), a row is out of range
                (naming it and N), or the rows are not sorted and unique.
        """
        columns = self.state_columns(values.shape[1] if values.dim() == 2 else 0)
        _check_tensors(values, state, grads, rows.numel(), columns)
        _check_rows(rows, values.shape[0])
        if rows.numel() == 0:
            return
        sel = _Rows(rows)
        w = sel.gather(values)
        st = {k: sel.gather(state[k]) for k in columns}
        self._update(w, st, grads.contiguous())
        sel.scatter(values, w)
        for k in columns:
            sel.scatter(state[k], st[k])

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        """Update the contiguous row blocks w and st in place (never g: it is the caller's)."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """A JSON-able description: make_updater(spec()) rebuilds this rule."""
        return {"name": self.name, **json.loads(json.dumps(asdict(self)))}  # type: ignore[call-overload]

    @classmethod
    def from_spec(cls, args: dict[str, Any]) -> Updater:
        valid = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(args) - valid)
        if unknown:
            raise ValueError(f"updater {cls.name!r}: unknown key(s) {unknown}; valid keys: "
                             f"{sorted(valid)}")
        return cls(**args)


def _in_range(rule: str, key: str, value: object, low: float, high: float = math.inf,
              *, strict: bool = False) -> float:
    """value as a float, if it is a finite number in [low, high) ((low, high) when strict)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > low if strict else v >= low) and v < high
    if not ok:
        want = f"{'>' if strict else '>='} {low}" + (f" and < {high}" if high < math.inf else "")
        raise ValueError(f"updater {rule!r}: {key} must be a finite number {want}, got {value!r}")
    return v


def _flag(rule: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"updater {rule!r}: {key} must be true or false, got {value!r}")
    return value


def _count_steps(st: dict[str, Tensor]) -> Tensor:
    """Advance each touched key's step count; returns it, (n, 1)."""
    steps = st["step"]
    steps.add_(1)  # float32 counts are exact up to 2**24 pushes of one key
    return steps


@dataclass
class Sgd(Updater):
    """torch.optim.SGD per key (a key's momentum buffer starts at its first gradient)."""

    name: ClassVar[str] = "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            setattr(self, key, _in_range(self.name, key, getattr(self, key), 0.0))
        if _flag(self.name, "nesterov", self.nesterov) and (self.momentum == 0 or self.dampening):
            raise ValueError("updater 'sgd': nesterov needs momentum > 0 and dampening == 0")

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"momentum_buffer": dim, "step": 1} if self.momentum else {}

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        g = _with_weight_decay(w, g, self.weight_decay)
        if self.momentum:
            g = self._momentum(st, g)
        _add(w, w, g * -self.lr)

    def _momentum(self, st: dict[str, Tensor], g: Tensor) -> Tensor:
        first = (_count_steps(st) == 1).squeeze(1)
        buf = st["momentum_buffer"]
        buf.mul_(self.momentum)
        _add(buf, buf, g * (1 - self.dampening))
        buf[first] = g[first]  # torch starts a buffer at the gradient itself, undamped
        if not self.nesterov:
            return buf
        out = buf * self.momentum
        _add(out, out, g)
        return out


@dataclass
class Adagrad(Updater):
    """torch.optim.Adagrad per key: a key's accumulator starts at initial_accumulator_value
    and its lr decay counts its own steps."""

    name: ClassVar[str] = "adagrad"
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _in_range(self.name, f.name, getattr(self, f.name), 0.0))

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"sum": dim, "step": 1}

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        steps = _count_steps(st)
        g = _with_weight_decay(w, g, self.weight_decay)
        acc = st["sum"]
        if self.initial_accumulator_value:  # state starts at zero; a first push sets it
            acc.masked_fill_(steps == 1, self.initial_accumulator_value)
        _add(acc, acc, _square(g))
        std = acc.sqrt().add_(self.eps)
        clr = self.lr / (1 + (steps.double() - 1) * self.lr_decay)  # in double, as torch
        _add(w, w, (g / std) * (-clr).float())


@dataclass
class Adam(Updater):
    """torch.optim.Adam per key; decoupled_weight_decay=True is torch.optim.AdamW.

    Bias correction uses the key's own step count: a key first pushed late is at step 1.
    """

    name: ClassVar[str] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        for key in ("lr", "eps", "weight_decay"):
            setattr(self, key, _in_range(self.name, key, getattr(self, key), 0.0))
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ValueError(f"updater 'adam': betas must be [beta1, beta2], got {self.betas!r}")
        b1, b2 = (_in_range(self.name, f"betas[{i}]", b, 0, 1) for i, b in enumerate(self.betas))
        self.betas = (b1, b2)
        _flag(self.name, "decoupled_weight_decay", self.decoupled_weight_decay)

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"exp_avg": dim, "exp_avg_sq": dim, "step": 1}

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        steps = _count_steps(st)
        b1, b2 = self.betas
        if self.decoupled_weight_decay:
            w.mul_(1 - self.lr * self.weight_decay)
        else:
            g = _with_weight_decay(w, g, self.weight_decay)
        st["exp_avg"].lerp_(g, 1 - b1)
        v = st["exp_avg_sq"]
        v.mul_(b2)
        _add(v, v, _square(g).mul_(1 - b2))
        step = steps.double()  # the corrections in double, as torch's Python floats
        step_size = (-self.lr / (1 - b1**step)).float()
        bc2_sqrt = (1 - b2**step).sqrt().float()
        denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
        _add(w, w, (st["exp_avg"] / denom) * step_size)


@dataclass
class Ftrl(Updater):
    """FTRL-Proximal per coordinate (McMahan et al., KDD 2013, Algorithm 1).

    values holds w; on a push, with g the gradient at the stored w:
    sigma = (sqrt(n + g^2) - sqrt(n)) / alpha, z += g - sigma * w, n += g^2, and then
    w = 0 where |z| <= l1, else -(z - sgn(z) l1) / ((beta + sqrt(n)) / alpha + l2).
    The paper starts w at 0; a nonzero initial value only enters the first sigma * w.
    """

    name: ClassVar[str] = "ftrl"
    alpha: float = 0.1
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        self.alpha = _in_range(self.name, "alpha", self.alpha, 0.0, strict=True)
        for key in ("beta", "l1", "l2"):
            setattr(self, key, _in_range(self.name, key, getattr(self, key), 0.0))

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"z": dim, "n": dim}

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        z, n = st["z"], st["n"]
        n_new = torch.empty_like(n)
        _add(n_new, n, _square(g))
        sigma = (n_new.sqrt() - n.sqrt()) / self.alpha
        _add(z, z, g - sigma * w)
        n.copy_(n_new)
        w.copy_(self._weights(z, n))

    def _weights(self, z: Tensor, n: Tensor) -> Tensor:
        w = -(z - z.sign() * self.l1) / ((self.beta + n.sqrt()) / self.alpha + self.l2)
        return w.masked_fill_(z.abs() <= self.l1, 0.0)


def _import_target(target: object) -> Callable[..., Tensor]:
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"updater 'callable': target must be 'package.module:function', got "
                         f"{target!r}")
    module, attr = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"updater 'callable': cannot import {target!r} ({e})") from e
    if not callable(fn):
        raise ValueError(f"updater 'callable': {target!r} is not callable")
    return fn


@dataclass
class CallableUpdater(Updater):
    """A user-defined rule, by import path: fn(values_rows, grads, state_rows, **kwargs).

    fn returns the new (n, d) values rows; it gets copies of everything and may update the
    state rows in place (they are written back). ``state`` names its state tensors:
    name -> columns, an int or "dim". Every other spec key is passed to fn as a keyword.
    """

    name: ClassVar[str] = "callable"
    target: str = ""
    state: dict[str, int | str] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._fn = _import_target(self.target)
        for key, cols in self.state.items():
            if cols != "dim" and (isinstance(cols, bool) or not isinstance(cols, int) or cols < 1):
                raise ValueError(f"updater 'callable': state[{key!r}] must be 'dim' or an int "
                                 f">= 1, got {cols!r}")
        try:
            json.dumps(self.kwargs)
            inspect.signature(self._fn).bind(None, None, {}, **self.kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"updater 'callable': {self.target} cannot take the keywords "
                             f"{sorted(self.kwargs)} as JSON-able arguments ({e})") from e

    def state_columns(self, dim: int) -> dict[str, int]:
        return {k: dim if c == "dim" else int(c) for k, c in self.state.items()}

    def _update(self, w: Tensor, st: dict[str, Tensor], g: Tensor) -> None:
        state_rows = {k: t.clone() for k, t in st.items()}  # written back only on success
        new = self._fn(w.clone(), g.clone(), state_rows, **self.kwargs)
        if not isinstance(new, torch.Tensor) or new.shape != w.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"updater 'callable': {self.target} returned {got}, expected a "
                             f"tensor of shape {tuple(w.shape)}")
        w.copy_(new)
        for k, t in st.items():
            t.copy_(state_rows[k])

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "state": dict(self.state),
                **self.kwargs}

    @classmethod
    def from_spec(cls, args: dict[str, Any]) -> Updater:
        rest = dict(args)
        target = rest.pop("target", None)
        state = rest.pop("state", {})
        if not isinstance(state, dict):
            raise ValueError(f"updater 'callable': state must be a dict, got {state!r}")
        return cls(target=target, state=state, kwargs=rest)


RULES: dict[str, type[Updater]] = {
    r.name: r for r in (Sgd, Adagrad, Adam, Ftrl, CallableUpdater)
}


def make_updater(spec: dict[str, Any] | str | Updater) -> Updater:
    """The updater a spec describes: a rule's name, {"name": ..., **settings}, or an Updater.

    Raises:
        ValueError: an unknown name or key (listing the valid ones), or a bad setting.
    """
    if isinstance(spec, Updater):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"an updater spec is a name, a dict or an Updater, got {spec!r}")
    args = dict(spec)
    name = args.pop("name", None)
    if name not in RULES:
        raise ValueError(f"unknown updater {name!r}; valid names: {sorted(RULES)}")
    return RULES[name].from_spec(args)

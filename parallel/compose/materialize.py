"""Weights for a model built on the meta device, made only where they are needed.

A model built under ``torch.device("meta")`` has shapes and no memory. Each rank gives
weights only to what it holds (its pipeline stage's modules, each tensor-parallel
module just before it is split, each ZeRO-3 unit just before it is sharded), so no rank
ever holds the whole model. So that every layout starts from the weights one process
has, a module's weights depend on nothing but ``(seed, its path)``: the plan's ``init``
(or the module's own ``reset_parameters``) runs with torch's generator seeded from
them. :func:`materialize` gives the whole model the same weights in one process.

A tied parameter takes the weights of its canonical owner (the first module that names
it), wherever the stage holding the other end is.

A mixture of experts' fused experts module (``(E, ...)`` tensors) is initialised expert
by expert, each from ``(seed, path, its index)``: so under expert parallelism a rank
makes only its ``E / ep`` experts (:meth:`Materializer.experts`), never the whole
module, and they equal those of the whole module made in one process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..plans.plan import under_any

InitFn = Callable[[str, nn.Module], None]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta for t in tensors)


def seed_of(seed: int, path: str) -> int:
    """A generator seed from the run's seed and a module's path alone."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def default_init(path: str, module: nn.Module) -> None:
    """``module.reset_parameters()``, torch's own initialisation of its layers.

    Raises:
        TypeError: naming the module, if it has none.
    """
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise TypeError(f"materialize: {path or '<root>'} ({type(module).__name__}) is on the "
                        "meta device and has no reset_parameters(); give the plan an init "
                        "(Plan.init(path, module)) that initialises it")
    reset()


class Materializer:
    """Gives meta modules of ``root`` their weights (see the module docstring).

    Args:
        root: the whole model.
        init: ``init(path, module)`` initialises the module's own parameters and buffers.
        seed: the run's seed.
        canonical: alias -> canonical name of every tied parameter.
        device: where the weights go.
        experts: paths of the fused experts modules (initialised expert by expert).
        held: the paths this rank holds (its pipeline stage's; None: the whole model). A
            tie's owner outside them is made only for its weights and left on the meta
            device again: its parameter lives on here in the module that shares it.
    """

    def __init__(self, root: nn.Module, init: InitFn | None, seed: int,
                 canonical: dict[str, str], device: torch.device | str = "cpu",
                 experts: list[str] | None = None, held: list[str] | None = None):
        self.root, self.init, self.seed = root, init or default_init, seed
        self.canonical, self.device = canonical, torch.device(device)
        self.expert_paths = set(experts or [])
        self.held = held

    def __call__(self, path: str, module: nn.Module) -> None:
        """Materialize ``module`` (at ``path``) and everything inside it."""
        for sub_path, sub in module.named_modules(prefix=path, remove_duplicate=False):
            self.module(sub_path, sub)

    def module(self, path: str, module: nn.Module) -> None:
        """Materialize ``module``'s own (not its children's) meta parameters and buffers
        (a module that takes its weights from elsewhere, a ZeRO-3 tile, by its own
        ``materialize_rows``)."""
        take = module.__dict__.get("materialize_rows")
        if take is not None:
            take(self)
            return
        names = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
        buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not names and not buffers:
            return
        tied = self._take_tied(path, module, names)
        own = [n for n in names if n not in tied]
        for name in own:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = self._fresh(p, p.shape)
        for name in buffers:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=self.device)  # type: ignore[arg-type]
        if path in self.expert_paths:
            self._init_experts(path, module, 0)
        else:
            self._run_init(path, module, tied)

    def experts(self, path: str, module: nn.Module, first: int, count: int) -> None:
        """Materialize experts ``first .. first + count - 1`` of the fused experts
        ``module`` alone: its ``(E, ...)`` meta tensors become ``(count, ...)`` tensors
        holding those experts' weights (expert parallelism's slice)."""
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = self._fresh(p, (count, *p.shape[1:]))
        self._init_experts(path, module, first)

    def _fresh(self, meta: nn.Parameter, shape: Any) -> nn.Parameter:
        """An uninitialised parameter of ``shape`` for ``meta``, keeping the marks
        strategies put on it while it was on the meta device."""
        made = nn.Parameter(torch.empty(shape, dtype=meta.dtype, device=self.device),
                            requires_grad=meta.requires_grad)
        made.__dict__.update(meta.__dict__)
        return made

    @torch.no_grad()
    def _init_experts(self, path: str, module: nn.Module, first: int) -> None:
        """Each expert of ``module``'s tensors (their first dimension) initialised alone,
        from ``(seed, path, first + i)``: the init runs on one-expert stand-ins."""
        whole = {n: p for n, p in module._parameters.items() if p is not None}
        count = next(iter(whole.values())).shape[0] if whole else 0
        for i in range(count):
            one = {n: nn.Parameter(torch.empty((1, *p.shape[1:]), dtype=p.dtype,
                                               device=p.device)) for n, p in whole.items()}
            module._parameters.update(one)
            if hasattr(module, "_is_hf_initialized"):
                module.__dict__["_is_hf_initialized"] = False
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed_of(self.seed, f"{path}[{first + i}]"))
                self.init(path, module)
            for n, p in whole.items():
                p[i].copy_(one[n][0])
        module._parameters.update(whole)

    def _take_tied(self, path: str, module: nn.Module, names: list[str]) -> dict[str, nn.Parameter]:
        """This module's tied parameters whose canonical owner is elsewhere: that owner is
        materialized (if it is not yet) and its parameter put here."""
        out = {}
        for name in names:
            full = f"{path}.{name}" if path else name
            owner = self.canonical.get(full, full)
            if owner == full:
                continue
            owner_path, _, attr = owner.rpartition(".")
            owner_module = self.root.get_submodule(owner_path)
            self.module(owner_path, owner_module)
            shared = owner_module._parameters[attr]
            assert shared is not None
            module._parameters[name] = out[name] = shared
            if self.held is not None and not under_any(owner_path, self.held):
                owner_module.to("meta")  # (a new meta parameter there; ``shared`` stays)
        return out

    @torch.no_grad()
    def _run_init(self, path: str, module: nn.Module, keep: dict[str, nn.Parameter]) -> None:
        saved = {n: p.detach().clone() for n, p in keep.items()}
        if hasattr(module, "_is_hf_initialized"):  # transformers skips what it marked
            module.__dict__["_is_hf_initialized"] = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_of(self.seed, path))
            self.init(path, module)
        for name, value in saved.items():  # a tied parameter keeps its owner's weights
            keep[name].copy_(value)


def materialize(model: nn.Module, seed: int, init: InitFn | None = None,
                experts: str | None = None) -> nn.Module:
    """The whole of a meta-device ``model`` with the weights every layout of
    ``parallelize(model, ..., ParallelConfig(seed=seed))`` starts from (one process: the
    reference the layouts are compared with); ``init`` and ``experts`` are the plan's
    (``Plan.init``, ``Plan.experts``). Returns ``model``."""
    from ..plans.plan import matching
    from ..tensor.tied import canonical_names, tie_groups

    paths = matching(experts, model) if experts is not None else []
    Materializer(model, init, seed, canonical_names(tie_groups(model)),
                 experts=paths)("", model)
    return model

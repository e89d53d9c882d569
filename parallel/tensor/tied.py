"""Tied parameters inside one model or pipeline stage: one ``nn.Parameter`` reached by
several names (an LM head sharing the token embedding's matrix) stays one parameter
after tensor parallelism replaced both ends' modules (:func:`retie`), so its gradients
from both uses accumulate in one ``.grad``, as in one process. (Ties across pipeline
stages are :class:`pycomm.parallel.compose.tied.CrossStageTies`.)"""

from __future__ import annotations

from torch import nn

from .sharding import spec_of


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of every parameter reached by more than one name, grouped, in module
    order (the first name of a group is its canonical name)."""
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def canonical_names(groups: list[list[str]]) -> dict[str, str]:
    """Every alias -> the canonical (first) name of its group."""
    return {alias: names[0] for names in groups for alias in names}


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return root.get_submodule(path), attr


def retie(root: nn.Module, groups: list[list[str]], held: set[str]) -> None:
    """After tensor parallelism replaced the modules of a tie, make the names this stage
    holds one parameter again (the first's).

    Raises:
        ValueError: naming both, if they were split differently.
    """
    for names in groups:
        here = [n for n in names if n in held]
        if len(here) < 2:
            continue
        first = root.get_parameter(here[0])
        for name in here[1:]:
            other = root.get_parameter(name)
            if other is first:
                continue
            if other.shape != first.shape or spec_of(other) != spec_of(first):
                raise ValueError(
                    f"tied parameters {here[0]} and {name}: tensor parallelism splits them "
                    f"differently ({tuple(first.shape)} {spec_of(first)} against "
                    f"{tuple(other.shape)} {spec_of(other)}); give both ends vocabulary "
                    "styles (vocab_embedding and vocab_head) or leave both replicated")
            module, attr = _owner(root, name)
            module._parameters[attr] = first

"""Noticing weights written into the model behind the optimizer's back.

ZeRO stages 1-2 keep the model's parameters as views of a flat buffer and, under mixed
precision, separate fp32 master shards; every step copies the masters back over the
parameters. So ``model.load_state_dict(...)`` or an in-place edit under ``no_grad`` would be undone
by the next step, and ``p.data = t`` would leave the parameter outside the buffer the
optimizer updates. Both are visible: an in-place write bumps the parameter's version
counter (each parameter has its own: ``p.data = view`` does not share the buffer's,
and the optimizer's own writes go through the buffer), and new data has another data
pointer. :class:`ParamWatch` compares both with what it last saw.

``load_state_dict(..., assign=True)`` replaces the Parameter objects themselves; as for
any torch optimizer, build the optimizer after such a load (stage 3's model notices it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ParamWatch:
    """Which parameters were written or replaced since :meth:`remember`.

    Args:
        params: the parameters.
        home: ``home(i)`` is where parameter ``i``'s values belong (a view of the
            optimizer's buffer, of the parameter's shape).
    """

    def __init__(self, params: Sequence[torch.Tensor], home: Callable[[int], torch.Tensor]):
        self.params, self._home = params, home
        self._homes = [_where(home(i)) for i in range(len(params))]
        self.remember()

    def remember(self) -> None:
        """The parameters as they are now count as seen."""
        self._versions = [p._version for p in self.params]

    @torch.no_grad()
    def changed(self) -> list[int]:
        """Indices of the parameters written or given new data since :meth:`remember`;
        new data is copied into the parameter's home, and the parameter pointed back at it.

        Raises:
            ValueError: a parameter's new data has another shape or dtype (``model.to``,
                ``.half()`` after building the optimizer: convert the model before).
        """
        out = []
        for i, p in enumerate(self.params):
            if _where(p) != self._homes[i]:
                home = self._home(i)
                if p.shape != home.shape or p.dtype != home.dtype:
                    raise ValueError(
                        f"ZeroOptimizer: parameter {i} now holds a {p.dtype} tensor of shape "
                        f"{tuple(p.shape)}, outside the optimizer's {home.dtype} buffer of "
                        f"shape {tuple(home.shape)}; convert the model before building the "
                        "optimizer")
                home.copy_(p.detach())
                p.data = home
                out.append(i)
            elif p._version != self._versions[i]:
                out.append(i)
        return out


def _where(t: torch.Tensor) -> tuple[int, torch.dtype, torch.Size]:
    return t.data_ptr(), t.dtype, t.shape

"""``MuonWithAdamW``: torch's Muon for hidden weight matrices and AdamW for everything else, as one
optimizer (what Muon's authors recommend), so a LightningModule keeps automatic optimization and
one step count.

It is a view over two torch optimizers sharing one ``state``: its ``param_groups`` are Muon's
groups then AdamW's (the same dicts), ``step`` runs the closure once, then Muon's step and
AdamW's. Under ``fsdp_custom`` each inner step is what the engine sees: Muon's matrices are placed
whole ([Note: whole-matrix placement]), AdamW steps the shards. Its ``state_dict`` is an ordinary
optimizer state dict (positions over both kinds of groups), so checkpoints and ``fsdp-consolidate``
treat it as any optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``, its defaults unless given in ``muon``) on ``matrices`` and AdamW
    (``torch.optim.AdamW``, with ``adamw``'s settings) on ``others``. Costs: those of the two."""

    def __init__(
        self,
        matrices: Iterable[torch.Tensor],
        others: Iterable[torch.Tensor] | Iterable[dict],
        muon: dict[str, Any] | None = None,
        adamw: dict[str, Any] | None = None,
    ) -> None:
        self.muon = torch.optim.Muon(matrices, **(muon or {}))
        self.adamw = torch.optim.AdamW(others, **(adamw or {}))
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Point both inner optimizers at this optimizer's groups and state (after a load too)."""
        count = len(self.muon.param_groups)
        self.muon.param_groups = self.param_groups[:count]
        self.adamw.param_groups = self.param_groups[count:]
        self.muon.state = self.adamw.state = self.state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:  # load_state_dict replaced the groups and the state
            self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (with grad) if given, then Muon's step and AdamW's; returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

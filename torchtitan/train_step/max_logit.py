"""QK-clip in the training step (``--optimizer.name MuonClip``): its term of the objective, which logs the largest
attention logit, and its place after the optimizer step (torchtitan/optim/qk_clip.py; docs/optimizers.md).

``MaxLogitTerm`` adds nothing to the loss (weight 0: it is neither a token term nor a carried one); it holds the
table's layout (the whole model's attention modules and heads, read before the pipeline split) and logs the
clip's last reduced table: ``attn/max_logit``, the largest over layers and heads, and ``attn/clipped_heads``,
the (layer, head) pairs above the threshold at the last step. The table is already the same on every rank, so
logging it needs no collective.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from torchtitan.optim.qk_clip import QKClip, attention_names, heads_of
from torchtitan.train_step.objective import Groups, LossTerm, Objective, TermSources

logger = logging.getLogger(__name__)

MUON_CLIP = "MuonClip"  # --optimizer.name


class MaxLogitTerm(LossTerm):
    """The max-logit log of QK-clip (see the module docstring); ``clip`` is set by ``install_qk_clip``."""

    name = "attn/max_logit"

    def __init__(self, rows: list[str], heads: int, threshold: float):
        self.rows, self.heads, self.threshold = rows, heads, threshold
        self.clip: QKClip | None = None

    @staticmethod
    def of(sources: TermSources) -> MaxLogitTerm | None:
        """The term of a MuonClip job, else None."""
        o = sources.cfg.optimizer
        if o.name != MUON_CLIP:
            return None
        rows = attention_names(sources.model)
        if not rows:
            raise ValueError(f"--optimizer.name={MUON_CLIP}: {type(sources.model).__name__} has no attention QK-clip "
                             "takes (grouped-query attention or MLA); use --optimizer.name Muon")
        module = sources.model.get_submodule(rows[0])
        return MaxLogitTerm(rows, heads_of(module), o.qk_clip_threshold)

    def metrics(self, groups: Groups) -> dict[str, float]:
        del groups  # the table was reduced over the world by the clip
        table = self.clip.last if self.clip is not None else None
        if table is None or not torch.isfinite(table.amax()):
            return {}
        return {self.name: float(table.amax()), "attn/clipped_heads": float((table > self.threshold).sum())}


def install_qk_clip(optimizer: torch.optim.Optimizer, model_parts: list[nn.Module], objective: Objective,
                    tp_mesh: torch.distributed.device_mesh.DeviceMesh | None) -> QKClip | None:
    """Watch this rank's attention modules and clip after every optimizer step, where the objective has the
    max-logit term (a MuonClip job); before any other post-step hook, which should see the clipped weights."""
    term = next((t for t in objective.terms if isinstance(t, MaxLogitTerm)), None)
    if term is None:
        return None
    clip = QKClip(model_parts, term.rows, term.heads, term.threshold, tp_mesh)
    term.clip = clip
    optimizer.register_step_post_hook(clip.after_optimizer_step)
    logger.info("QK-clip: %d attention modules here of %d, %d heads each, threshold %g", len(clip.watched),
                len(term.rows), term.heads, term.threshold)
    return clip

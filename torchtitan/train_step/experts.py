"""The experts of a model with MoE layers, step by step: their balancing, and what the trainer logs of them.

- **Auxiliary-loss-free balancing** (DeepSeek-V3): at the step tail's ``balance_experts`` point, just
  before the optimizer step (so after every micro-batch and pipeline microbatch of the step), each MoE layer's
  token counts are summed over the ranks that route different tokens (``dp x cp``: not TP, whose
  ranks route the same tokens, unless expert parallelism borrows them; per pipeline stage, which holds
  its own layers), and each
  router's bias moves toward balance (``models/expert_balance.py``). The counts exclude activation
  recompute (a layer counts in the original forward only).
- **Auxiliary loss**: a term of the step's objective (``train_step/aux_loss.py``), which logs itself.
- **What is logged** (``metrics``, on logging steps, every rank): the load imbalance (max over mean
  tokens per expert of each layer: the mean and the max over layers) and the tokens each expert
  received (over all sparse layers), since the last log.

The MoE layers come from the family's model, ``Decoder.expert_layers`` as ``ExpertLayer``s: the step never
imports the MoE component (``models/moe``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed import ParallelDims
from torchtitan.models.common.config import DecoderConfig
from torchtitan.models.expert_balance import ExpertLayer, imbalance, reduce_counts, update_expert_bias
from torchtitan.models.spec import family_model


class ExpertBalance:
    """The MoE layers of this rank's model parts, balanced at each step's tail; see the module docstring."""

    def __init__(self, moes: list[ExpertLayer], num_experts: int, coeff: float, dims: ParallelDims):
        # A pipeline stage may hold no MoE layer; it still takes part in the logging collectives.
        self.moes = moes
        self.num_experts = num_experts
        self.coeff, self.dims = coeff, dims
        # dp x cp, and tp where expert parallelism borrows TP's ranks (each TP rank then routes its own tokens)
        routing_mesh: DeviceMesh | None = dims.routing_mesh()
        self.group = None if routing_mesh is None else routing_mesh.get_group()
        self.biased = any(m.expert_bias is not None for m in self.moes)
        self.window: torch.Tensor | None = None  # [L, E] tokens per expert since the last log
        self.window_reduced = self.biased  # the bias update sums the counts over dp x cp each step

    @staticmethod
    def of(model_parts: Sequence[torch.nn.Module], args: DecoderConfig, coeff: float,
           dims: ParallelDims) -> ExpertBalance | None:
        """The balance of the MoE layers of ``model_parts``, a model of ``args`` (None for a dense model)."""
        num_experts = args.num_experts
        if not num_experts:
            return None
        moes = [m for part in model_parts for m in family_model(part, "ExpertBalance").expert_layers()]
        return ExpertBalance(moes, num_experts, coeff, dims)

    def update(self) -> None:
        """Move the routing biases from the step's counts (summed over dp x cp) and keep the counts for the log.

        The step's tail calls it just before the optimizer step (``StepStrategy.finish``)."""
        if not self.moes:
            return
        if self.biased:
            counts = update_expert_bias(self.moes, self.coeff, self.group)
        else:
            counts = torch.stack([m.tokens_per_expert.clone() for m in self.moes])
            for moe in self.moes:
                moe.tokens_per_expert.zero_()
        self.window = counts if self.window is None else self.window + counts

    def metrics(self) -> dict[str, float]:
        """The window's imbalance and tokens per expert, over every rank and pipeline stage.

        Collectives over the whole world: every rank calls this on the same (logging) steps.
        """
        num_experts = self.num_experts
        window = self.window if self.window is not None else torch.zeros(len(self.moes), num_experts, dtype=torch.int64)
        if not self.window_reduced:
            window = reduce_counts(list(window), self.group) if len(window) else window
        self.window = None
        per_layer = imbalance(window) if len(window) else torch.zeros(0, dtype=torch.float64)
        sums = torch.tensor([float(per_layer.sum()), len(per_layer)], dtype=torch.float64)
        sums = torch.cat([sums, window.sum(dim=0).double().cpu() if len(window) else torch.zeros(num_experts,
                                                                                                  dtype=torch.float64)])
        peak = per_layer.max().reshape(1).cpu() if len(per_layer) else torch.zeros(1, dtype=torch.float64)
        sums, peak = self._over_world(sums, peak)
        # The counts (and so the imbalance) are already summed over dp x cp (x tp where EP borrows TP's
        # ranks), and TP ranks hold the same: every rank of a stage adds the same values, dp x cp x tp times.
        copies = self.dims.degree("dp_cp") * self.dims.tp
        out: dict[str, float] = {}
        if sums[1] > 0:
            out["moe/imbalance"] = float(sums[0] / sums[1])
            out["moe/imbalance_max"] = float(peak[0])
            for e, tokens in enumerate((sums[2:] / copies).tolist()):
                out[f"moe/tokens_per_expert/{e}"] = round(tokens)
        return out

    def _over_world(self, sums: torch.Tensor, peak: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``sums`` summed and ``peak`` maxed over every rank (the process group's device)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return sums, peak
        device = self.moes[0].tokens_per_expert.device if self.moes else torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        sums, peak = sums.to(device), peak.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return sums.cpu(), peak.cpu()

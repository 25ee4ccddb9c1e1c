"""GPT-OSS's tensor-parallel plan (``GptOssModel.apply_tp``): the decoder's (``models/common/parallel.py``, with
the attention module's own plan), then the sinks (``shard_sinks``).

Column-parallel q/k/v shard their biases with their rows; the row-parallel output projection keeps its
bias replicated and DTensor adds it once to the reduced sum. The experts are replicated over TP (every
TP rank computes the same tokens), so their output bias is added once too. The per-head ``sinks``
follow the heads: ``Shard(0)``, each rank keeps its heads' logits.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan.models.common.decoder import Decoder
from torchtitan.models.gpt_oss.attention import SinkAttention


def shard_sinks(model: Decoder, tp_mesh: DeviceMesh) -> None:
    """Each attention's ``sinks`` [H] as a DTensor ``Shard(0)`` on ``tp_mesh`` (this rank's heads), made from
    the local slice without a collective (works on a meta model; initialise after)."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for block in model.blocks():
        attention = block.attention
        if not isinstance(attention, SinkAttention):  # every GPT-OSS block's; a Decoder of another family has none
            raise TypeError(f"shard_sinks takes a GPT-OSS model; its blocks hold {type(attention).__name__}, not "
                            "SinkAttention")
        full = attention.sinks
        per_rank = full.shape[0] // tp
        local = full.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
        attention.sinks = nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False),
                                       requires_grad=full.requires_grad)


"""The dtypes a config may name (mixed precision, exports), as torch dtypes."""

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

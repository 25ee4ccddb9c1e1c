"""What model families share above the building blocks of ``models/layers.py``: the decoder skeleton
(``decoder``), the MoE-capable decoder of Qwen3 and Mixtral (``moe_decoder``), its parallelism and its
Hugging Face names. No family is imported here."""

#!/usr/bin/env python
"""Tokenize a corpus into a token store folder; see torchtitan/datasets/prepare.py.

    python scripts/prepare_data.py data/my_corpus/ /data/stores/my_corpus --workers 16
    python train.py ... --training.dataset_path /data/stores/my_corpus
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.datasets.prepare import main  # noqa: E402

if __name__ == "__main__":
    main()

"""Downstream evaluation during training: multiple-choice tasks scored in the loop (docs/evaluation.md).

``tasks.py`` reads tasks, ``continuation.py`` builds the shipped one, ``encoding.py`` turns requests
into token rows, ``scores.py`` computes the metrics, ``evaluator.py`` runs the rows through the
model in any layout, and ``build.py`` wires ``[eval]`` to preflight and the trainer.
"""

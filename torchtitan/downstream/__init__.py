"""Downstream evaluation during training: multiple-choice tasks scored in the loop (docs/evaluation.md).

``request.py`` is what a request is, ``continuation.py`` builds the shipped task, ``tasks.py`` reads
task files and resolves ``[eval] tasks`` names, ``encoding.py`` turns requests
into token rows, ``scores.py`` computes the metrics, ``evaluator.py`` runs the rows through the
model in any layout, and ``build.py`` wires ``[eval]`` to preflight and the trainer.
"""

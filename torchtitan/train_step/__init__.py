"""The optimizer step as a strategy the trainer builds once and calls every step.

- ``base``:   what a step needs of the trainer (``StepModel``, ``StepParts``), what it returns
              (``StepOutput``), and ``StepStrategy``, whose pieces every step's tail is made of;
- ``plain``:  ``PlainStep``, the step of a job that is one process group;
- ``select``: ``build_step_strategy``, which picks the plain step or a fault-tolerant one
              (``fault_tolerance/step.py``, ``fault_tolerance/semi_sync_step.py``).

The trainer knows only ``StepStrategy``: ``start(step)`` gives the batches, ``run(batches, step)``
takes one optimizer step, ``writes_checkpoint`` and ``checkpoint_states`` go to the
checkpointer's constructor, ``close()`` ends it.
"""

from torchtitan.train_step.base import StepModel, StepOutput, StepParts, StepStrategy
from torchtitan.train_step.plain import PlainStep

__all__ = ["PlainStep", "StepModel", "StepOutput", "StepParts", "StepStrategy"]

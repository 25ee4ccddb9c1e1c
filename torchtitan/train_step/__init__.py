"""The optimizer step: the model runner it drives, and the strategy the trainer builds once and calls every step.

- ``runner``:    ``ModelRunner``, the model parts, pipeline schedule, optimizer and LR schedule, and the
                 forward/backward of a step's micro-batches (plain or pipelined) and of validation;
- ``build``:     ``build_runner``, the one function that builds it, for the trainer and the planner's dry run;
- ``callbacks``: ``StepCallbacks``, callables called at the named points of a step (``StepPoint``);
- ``base``:      ``StepParts``, ``StepOutput`` and ``StepStrategy``, whose ``finish`` is every step's tail;
- ``plain``:     ``PlainStep``, the step of a job that is one process group;
- ``select``:    ``build_step_strategy``, which picks the plain step or a fault-tolerant one
                 (``fault_tolerance/step.py``, ``fault_tolerance/semi_sync_step.py``).

The trainer knows only ``StepStrategy``: ``start(step)`` gives the batches, ``run(batches, step)``
takes one optimizer step, ``writes_checkpoint`` and ``checkpoint_states`` go to the
checkpointer's constructor, ``close()`` ends it.
"""

from torchtitan.train_step.base import StepOutput, StepParts, StepStrategy
from torchtitan.train_step.callbacks import StepCallbacks, StepEvent, StepPoint
from torchtitan.train_step.plain import PlainStep
from torchtitan.train_step.runner import ModelRunner

__all__ = ["ModelRunner", "PlainStep", "StepCallbacks", "StepEvent", "StepOutput", "StepParts", "StepPoint",
           "StepStrategy"]

"""Fault-tolerant HSDP with torchft: each replica group is one torchrun job; groups die and rejoin.

- ``checks``:  the config checks preflight runs (no torchft import);
- ``manager``: the torchft manager, after clearing a dead manager's keys in torchrun's store;
- ``hooks``:   the cross-group gradient all-reduce in every FSDP unit, and the check that none is missed;
- ``state``:   what a rejoining group receives from a live peer (cached references);
- ``data``:    the group's position (step, batches), which a heal moves to the peer's;
- ``step``:    the step strategy (quorum, commit or retry, global loss), a ``train_step.StepStrategy``;
- ``semi_sync``: DiLoCo/LocalSGD with torchft's own classes: fragments, outer optimizer, checkpoint state;
- ``semi_sync_step``: the step protocol under DiLoCo/LocalSGD (local inner steps, a sync every few steps);
- ``replica_check``: the groups compare fingerprints of their weights and optimizer state;
- ``setup``:   building a replica group's step strategy (manager, heal state, hooks or DiLoCo/LocalSGD).
"""

"""The two test tiers: ``pytest -m "not slow"`` (fast, no process spawned) and everything.

A test is ``slow`` when it starts a process: a gloo world (``dist_harness.run_ranks``),
torchrun, ``train.py`` or a script in a subprocess. ``SLOW`` below names them, per test
module, so that marking them needs no edit to the test files; a module may also carry
``pytestmark = pytest.mark.slow`` or a test ``@pytest.mark.slow`` itself.

The fast tier checks the table: while slow tests are deselected, a test that starts a
process anyway fails with a message naming it, so a new spawning test cannot quietly
make the fast tier slow. CI runs both tiers (no ``-m``), where nothing is checked.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Module (relative to tests/) -> the tests in it that start processes; ALL: every test.
ALL = frozenset({"*"})
SLOW: dict[str, frozenset[str]] = {
    "benchmarks/test_footprint.py": ALL,
    "checkpoint/test_crash_safety.py": ALL,
    "checkpoint/test_formats.py": frozenset({
        "test_loads_into_tp2_pp2_cp2_ddp2_give_hf_step1_loss",
        "test_torchrun_fsdp2_from_hf_then_export_round_trip"}),
    "checkpoint/test_load_agreement.py": ALL,
    "checkpoint/test_releases.py": frozenset({
        "test_bad_releases_through_the_launcher_exit_2_one_line_each",
        "test_real_configs_load_and_train_tied_in_fsdp_tp_pp", "test_torchrun_tied_release_round_trip"}),
    "checkpoint/test_resume.py": ALL,
    "checkpoint/test_seed_and_reshard.py": ALL,
    "config/test_config.py": frozenset({
        "test_config_error_is_one_line_per_problem_and_nonzero_exit",
        "test_help_lists_every_option",
    }),
    # The module's ``store`` fixture prepares with two worker processes.
    "datasets/test_token_store.py": frozenset({
        "test_bad_stores_are_named", "test_interrupted_preparation_is_not_used_and_resumes",
        "test_prefetch_errors_reach_the_training_thread",
        "test_a_busy_prefetch_thread_does_not_abort_the_interpreters_exit",
        "test_positions_restart_per_document_and_resume_exactly",
        "test_block_causal_refuses_a_store_without_document_boundaries", "test_resume_anywhere_at_any_dp_degree",
        "test_shuffled_stream_is_independent_of_dp_degree_and_accumulation",
        "test_store_holds_the_packed_stream",
        "test_trainer_preflight_names_a_bad_store_before_any_process_group"}),
    "distributed/test_context_parallel.py": frozenset({
        "test_cp_attention_compiled_equals_full_attention",
        "test_cp_attention_equals_full_attention",
    }),
    "distributed/test_layout_parity.py": ALL,
    "distributed/test_lifecycle.py": ALL,
    "distributed/test_parallel_dims.py": frozenset({
        "test_meshes_on_eight_ranks", "test_world_size_one"}),
    "distributed/test_pipeline_parallel.py": frozenset({
        "test_bad_configs_fail_on_every_rank_without_a_collective", "test_control_learns",
        "test_pipeline_layout_matches_control", "test_pipeline_ranks_hold_disjoint_stages"}),
    "distributed/test_seeding.py": frozenset({
        "test_four_dim_mesh_default_order", "test_no_collective_is_issued",
        "test_two_eight_rank_tables_and_real_draws", "test_unknown_dim_rejected_on_every_rank"}),
    "distributed/test_tensor_parallel.py": ALL,
    "distributed/test_tp_cp_layouts.py": ALL,
    "fault_tolerance/test_diloco_run.py": ALL,
    "fault_tolerance/test_ft_runs.py": ALL,
    "fault_tolerance/test_startup.py": ALL,
    "fault_tolerance/test_parts.py": frozenset({
        "test_a_parameter_outside_every_hooked_unit_is_refused"}),
    "scripts/test_loss_compare.py": frozenset({
        "test_plot_is_a_png", "test_runs_jobs_through_the_launcher"}),
    "test_evaluate.py": frozenset({
        "test_validation_loss_is_the_mean_token_loss_of_the_split_and_is_logged"}),
    "test_faults.py": ALL,
    "test_multinode.py": ALL,
    "test_tiers.py": frozenset({"test_full_run_lets_every_test_start_processes"}),
    "test_trainer.py": ALL,
    "train_step/test_host_reads.py": ALL,
    "checkpoint/test_disk_full.py": frozenset({
        "test_a_first_save_that_does_not_fit_is_named_and_writes_nothing",
        "test_a_later_save_that_fills_the_disk_keeps_the_earlier_checkpoint_bitwise",
        "test_the_check_before_a_save_uses_the_previous_checkpoints_size",
    }),
    "checkpoint/test_integrity.py": frozenset({
        "test_a_flipped_byte_is_caught_and_the_restart_resumes_bitwise_from_the_step_before"}),
    "distributed/test_document_mask.py": frozenset({
        "test_cp_document_mask_matches_one_process",
        "test_layouts_train_what_one_process_trains",
    }),
    "metrics/test_wandb.py": frozenset({
        "test_missing_wandb_is_one_line_before_any_process_group",
        "test_offline_run_has_tensorboards_scalars_and_the_config",
        "test_resumed_job_continues_the_same_run",
    }),
    "models/test_attention.py": frozenset({
        "test_compiled_block_uses_the_dense_mask_and_matches_eager"}),
    "scripts/test_install.py": frozenset({
        "test_cpu_build_pin_keeps_its_local_version",
        "test_cuda_build_is_kept_and_pinned_by_its_distribution_version",
        "test_old_torch_gets_the_cpu_default_first",
    }),
    "test_compat.py": frozenset({
        "test_all_process_groups_lists_every_group",
        "test_default_store",
        "test_dtensor_rng_tracker",
        "test_fsdp_param_groups_and_all_reduce_hook",
        "test_functional_collectives",
        "test_wait_async_collective_keeps_the_gradient",
        "test_local_shape_and_global_offset",
        "test_set_pg_timeout_changes_a_live_groups_timeout",
    }),
    "planning/test_plan.py": frozenset({
        "test_a_layout_that_does_not_fit_names_its_largest_consumer",
        "test_bad_config_fails_with_the_launchs_lines",
        "test_cost_model_orders_and_units",
        "test_memory_of_fsdp2_tp2_is_its_local_shards",
        "test_plan_json_and_bad_inputs",
        "test_state_agrees_with_a_real_trainers_tensors",
        "test_traffic_of_fsdp2_tp2_equals_the_hand_count",
    }),
    "planning/test_train_configs.py": frozenset({
        "test_search_returns_accepted_layouts_and_the_best_trains",
        "test_shipped_configs_dry_run_at_their_world_sizes",
    }),
}

_TESTS = Path(__file__).resolve().parent


def _is_slow(item: pytest.Item) -> bool:
    try:
        module = Path(item.path).resolve().relative_to(_TESTS).as_posix()
    except ValueError:  # a test outside tests/ (none today)
        return False
    names = SLOW.get(module, frozenset())
    return names is ALL or getattr(item, "originalname", item.name) in names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)


def _fast_tier(config: pytest.Config) -> bool:
    # Only a run that asked for the fast tier is checked; the full run (CI) spawns freely.
    return "not slow" in (config.option.markexpr or "")


def _refuse(what: str) -> Callable[..., None]:
    def start(*args: object, **kwargs: object) -> None:
        # pytest.fail raises a BaseException: no ``except Exception`` or ``pytest.raises`` in the
        # test can take it for the failure it expects.
        pytest.fail(
            f"this test starts a process ({what}) but is not marked slow: add it to SLOW in "
            "tests/tiers.py (or mark it @pytest.mark.slow) so that `pytest -m 'not slow'` stays fast",
            pytrace=False,
        )
    return start


@contextlib.contextmanager
def _guarded(item: pytest.Item) -> Iterator[None]:
    """Refuse process starts while ``item`` (and its fixtures, of any scope) sets up and runs."""
    if not _fast_tier(item.config) or item.get_closest_marker("slow") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _guarded(item):
        yield

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import logging

import pytest
import torch

import graphopt

# pytest (9.x) attaches its log-capture handlers to every logger that does not propagate,
# torch's structured-trace logger among them; torch computes each trace payload (graphs
# printed, guards dumped) whenever that logger has a handler, so every compile in the suite
# did that work for pytest's captured DEBUG records. It is TORCH_TRACE's output, not a
# log: unless TORCH_TRACE is set, the logger takes no handler from pytest.
if "TORCH_TRACE" not in os.environ:
    logging.getLogger("torch.__trace").addHandler = lambda handler: None  # type: ignore

# Under pytest-xdist (README's `-n 2`) the workers share the cores: each takes its share of
# torch's threads instead of all of them (two workers of 2 threads each on 2 cores slowed
# the compute-bound tests)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    graphopt.clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_env_dump_dir(monkeypatch):
    monkeypatch.delenv("GRAPHOPT_DUMP_DIR", raising=False)


# The slowest tests first (longest-processing-time-first scheduling): xdist deals the
# collected tests out in order, so a 60-120 s test collected late ran on one worker while
# the other sat idle at the end of the suite. Measured with `python -m pytest -q -n 2
# --durations=40` (2026-12-07, slowest first); a renamed test only loses its place.
SLOWEST = (
    "test_parallel.py::test_compiled_plans_train_exactly_on_new_sequence_lengths",
    "test_lightning_triton.py::test_triton_kernels_match_reference_under_interpreter",
    "test_parallel_accumulate.py::test_hsdp_all_reduces_once_and_pipeline_holds_unsharded_gradients",
    "test_pass_attention.py::test_minimax_model_recompiled_for_a_new_length_keeps_the_rewrite",
    "test_moe_ep.py::test_expert_parallel_schedules_equal_single_process[4]",
    "test_parallel.py::test_parallel_auto_executes_the_planner_s_best_executable_plan",
    "test_onnx_export.py::test_fourth_review_findings_leave_the_model_as_given_and_grow_sizes_as_exported",
    "test_parallel_checkpoint.py::test_a_checkpoint_saved_under_one_plan_resumes_under_another",
    "test_lightning_triton.py::test_eager_triton_step_launches_no_zero_fill",
    "test_pass_attention.py::test_minimax_model_exact_mode_matches_eager_logits_and_gradients",
    "test_parallel_checkpoint.py::test_tensor_parallel_experts_fsdp_split_checkpoints_resume_on_8_ranks",
    "test_cli.py::test_demo_lists_why_sites_were_skipped",
    "test_pass_attention_softmax.py::test_lightning_mode_on_real_models_equals_lightning_attention_per_layer[gpt2-eager-True]",
    "test_moe_ep.py::test_one_rank_changing_its_token_count_under_default_dynamic_recompiles_statically",
    "test_parallel.py::test_torch_compile_of_user_wrapped_ddp_and_fsdp2_models",
    "test_pass_attention.py::test_float32_rounded_decay_tables_in_a_float64_model_are_reported",
    "test_lightning_triton.py::test_packed_sequences_take_the_eager_path_and_build_the_chunk_table_once",
    "test_onnx_export.py::test_minimax_exact_exports_with_dynamic_axes_and_equals_transformers",
    "test_lightning_triton.py::test_sequential_state_pass_equals_the_parallel_one_bit_for_bit",
    "test_more_models.py::test_training_step_matches_eager[jetmoe]",
    "test_lightning_triton.py::test_chunk_table_kernel_equals_the_torch_construction",
    "test_cli.py::test_demo_parallel_runs_a_planned_step_on_local_ranks",
    "test_parallel.py::test_example_runs_under_torchrun",
    "test_parallel_accumulate.py::test_replicas_reduce_once_fsdp_every_microbatch",
    "test_parallel.py::test_graphopt_compile_compiles_every_layer_and_converts_lightning_as_one_process",
    "test_lightning_triton.py::test_autotuned_launch_path_runs_and_matches_under_interpreter",
    "test_parallel.py::test_torch_compile_of_a_whole_tensor_parallel_model",
    "test_parallel_pp.py::test_pipeline_plans_train_like_one_process[4]",
    "test_pass_remat.py::test_mixtral_at_two_budgets_keeps_gradients",
    "test_onnx_export.py::test_third_review_findings_are_exact_or_refused",
    "test_onnx_export.py::test_check_compares_left_padded_batches_where_the_mask_keeps",
    "test_pass_attention.py::test_bf16_minimax_model_is_rewritten_and_as_accurate_as_eager",
    "test_onnx_export.py::test_second_review_findings_fail_early_with_the_fix",
    "test_pass_moe.py::test_eager_experts_loop_is_reported_with_the_fix",
    "test_parallel.py::test_graphopt_compile_with_a_parallel_plan_file[mixtral-False]",
    "test_parallel.py::test_graphopt_compile_with_a_parallel_plan_file[llama-True]",
    "test_onnx_export.py::test_float64_exports_are_checked_at_a_float64_tolerance[minimax-options1]",
    "test_lightning_triton.py::test_host_benchmark_runs_and_its_launch_counts_hold",
    "test_onnx_export.py::test_export_keeps_the_model_s_train_eval_modes_and_dense_moe_stays_finite",
    "test_pass_attention.py::test_forward_mode_tangents_through_graphopt_s_ops_equal_eager",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.removeprefix("tests/"), len(rank))

    items.sort(key=key)  # stable: the others keep their order

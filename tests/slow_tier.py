"""The slow tier and the on-demand tier: what the default run leaves out, and what CI leaves out.

The default run (`python -m pytest -n 2 tests`, the README command) deselects both; `-m slow` runs the slow tier;
CI (`.ci/run`) runs the default tier, then the slow one, in its 90 minutes on a 2-core machine. `-m matrix` runs the
on-demand tier: checks beyond that budget (the full composition product, mesh and multi-process variants whose
features a cheaper CI test covers). Keeping the lists in one place shows what each tier gives up and why each
feature stays covered. An entry is a node id, with or without its parameters (without: every parametrization).
`tests/conftest.py` marks them and fails the run when an entry names a test that no longer exists in a collected
file, so a rename cannot quietly move a test into another tier.
"""

# node id -> what else covers its feature: a default-tier test, or a cheaper sibling here whose own entry names the
# default-tier tests that stay (the sixth cut moved several siblings here)
SLOW = {
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_every_variant[v41-bf16]":
        "test_invariant_logits_on_random_traces[v4-bf16] (the default tier's draw)",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_with_drafts_and_tier_reloads[v4-bf16]":
        "test_invariant_logits_on_random_traces[v4-bf16], tests/dsv4/test_engine_spec.py::test_trained_drafts_give_"
        "the_same_greedy_tokens",
    "tests/cache/test_step_plan.py::test_step_plans_match_the_managers_own_calls":
        "tests/cache/test_step_props.py::test_apply_step_matches_reference (the packed step against the plain "
        "reference after every op), test_engine_step.py (the engine's own plans, engine == forward_full)",
    "tests/experiments/test_serve_tiers.py::test_an_unreachable_store_is_one_warning_and_the_run_goes_on":
        "tests/cache/tiers (a backend whose server is gone: announced, the run goes on), test_serve_tiers.py "
        "(a second process reloads the first one's disk records)",
    # speculative decoding: forced partly-wrong drafts on a window + CSA + HCA model (every rollback length)
    "tests/dsv4/test_engine_spec.py::test_drafts_compose_with_tiers_and_kv_precision[fp8-bf16]":
        "test_trained_drafts_give_the_same_greedy_tokens (drafts with preemption and prefix hits)",
    "tests/dsv4/test_engine_spec.py::test_partly_wrong_drafts_never_change_tokens":
        "test_trained_drafts_give_the_same_greedy_tokens (real drafts, rejections, preemption, hits)",
    "tests/dsv4/test_engine_spec.py::test_sampled_async_equals_sync":
        "test_rejection_sampling_keeps_the_distribution (the sampled verifier both engines run)",
    "tests/dsv4/test_engine_spec.py::test_prefix_hit_carries_the_mtp_window":
        "test_trained_drafts_give_the_same_greedy_tokens (prefix hits with drafts)",
    # the default tier's 8-minute budget: each has a sibling that exercises the same code in the default tier
    "tests/dsv4/test_row_invariant.py::test_dead_rows_of_loop_buffers_reach_no_live_row_on_the_kernels":
        "test_row_invariant.py::test_in_place_updates_and_unwritten_buffers_keep_the_bits (NaN loop buffers on the "
        "XLA ops), the kernels' live-bound tests in tests/pallas_kernels/test_sparse_attention.py and "
        "test_hca_attention.py",
    "tests/experiments/test_train_mtp.py::test_recursive_passes_are_the_engines_recursion":
        "test_train_mtp.py::test_train_mtp_small_cli (the recursion objective runs) and test_engine_spec.py (the "
        "engine's recursion drafts)",
    "tests/dsv4/test_engine_step.py::test_compile_counts_belong_to_their_engine":
        "test_engine_step.py::test_compilation_is_bounded_and_counted (the counts of one engine)",
    "tests/cache/test_acceptance.py::test_hybrid_limiting_group[256-swa-27-768]":
        "test_hybrid_limiting_group's other rows",
    # V4.1's DSpark drafter: bitwise drafts on / off under the invariant step, tiers and the P/D handoff
    "tests/dsv4/test_dspark_engine.py::test_drafts_on_or_off_same_bits":
        "test_dspark_engine.py::test_served_drafts_equal_drafts_from_scratch (drafts from the cache equal drafts "
        "from scratch) and test_drafts_never_change_greedy_tokens",
    # meshes (8 host devices, a worker process each) and multi-process runs
    "tests/dsv4/test_sharding_multiprocess.py::test_two_processes_same_tokens_as_one":
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] (the mesh engine in one process)",
    "tests/dsv4/test_sharding.py::test_sharded_forward_matches_one_device":
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] runs the sharded step on (2,2,2)",
    # async scheduling: the other mixes (each runs a sync and an async engine)
    "tests/dsv4/test_engine_step.py::test_host_bytes_per_step_do_not_grow_with_context":
        "test_one_transfer_each_way_per_step (one plan buffer in, one token buffer out, under a transfer guard)",
    # batch invariance: the step program, in a child at XLA's default level
    "tests/dsv4/test_engine_step.py::test_batch_invariant_mode_is_bitwise":
        "test_composition.py::test_all_pairs_one_device_v4 (every row: a request alone == batched)",
    "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v41]":
        "the [v4] variant (same engine code; V4.1's model: tests/dsv4/test_v41_parity.py)",
    # KV tiers end to end: every tier, Mooncake, Redis across processes, the V4.1 variants
    "tests/dsv4/test_tiers_reload.py::test_reload_gate_mooncake": "tests/cache/tiers/test_tiers.py (Mooncake store)",
    # every V4.1 variant of a test whose V4 variant stays fast
    "tests/dsv4/test_tiers_reload.py::test_corrupt_records_are_rejected_and_recomputed[v41-truncated]": "[v4-*]",
    "tests/dsv4/test_tiers_reload.py::test_corrupt_records_are_rejected_and_recomputed[v41-flipped_bit]": "[v4-*]",
    "tests/dsv4/test_tiers_reload.py::test_other_model_layout_or_tenant_never_loads[v41]": "[v4]",
    "tests/cache/test_manager.py::test_events_stream":
        "tests/experiments/test_serve_tiers.py (the tiers consume the stream: records stored as blocks are computed, "
        "reloaded by a second process), test_manager.py::test_hit_blocks_are_claimed_and_tables_consistent",
    "tests/dsv4/test_mtp.py::test_chunked_and_nnx_equal_the_whole_sequence":
        "test_engine_spec.py::test_trained_drafts_give_the_same_greedy_tokens (the block over chunked prefills and "
        "decodes in the engine), test_mtp.py::test_loader_names_and_refusals",
    "tests/dsv4/test_mtp.py::test_mtp_logits_match_nemo":
        "test_mtp.py::test_loader_names_and_refusals (the block's checkpoint names), test_engine_spec.py (the "
        "block drafting in the engine); the oracle builds NeMo's model in torch",
    "tests/dsv4/test_mtp.py::test_nemo_naming_is_nemos_state_dict":
        "test_loading_namings.py::test_mtp_blocks_round_trip_in_every_naming (the block in every naming); the "
        "oracle builds NeMo's model in torch",
    "tests/dsv4/test_mtp.py::test_hf_layer_form_reads_through_nemos_adapter":
        "test_loading_namings.py::test_mtp_blocks_round_trip_in_every_naming[hf], "
        "test_hf_directory_with_deepseek_spelled_mtp (both HF forms of the block load)",
    "tests/dsv4/test_model_ragged.py::test_ragged_random_mix_matches_full":
        "test_engine_step.py::test_engine_equals_forward_full[v4] (the engine's ragged steps: chunked prefills mixed "
        "with decodes, resumes and preemption == forward_full), test_mtp.py (chunked == whole)",
    "tests/dsv4/test_model_ragged.py::test_resume_from_checkpoint_equals_scratch":
        "test_engine_step.py::test_engine_equals_forward_full[v4] (later turns resume from SWA checkpoints == "
        "forward_full), test_composition.py (prefix hits in every row)",
    "tests/dsv4/test_model_ragged.py::test_swa_table_cut_to_the_window_is_bitwise_the_same":
        "a step-width optimisation; the cut tables run in every engine test",
    "tests/dsv4/test_model_ragged.py::test_paged_indexer_equals_reference_path":
        "tests/pallas_kernels/test_indexer_paged.py (the paged indexer vs its reference)",
    "tests/dsv4/test_model_ragged.py::test_precision_modes_with_discrete_choices":
        "test_precision_modes (every position bounded, same modes)",
    "tests/dsv4/test_model_cached.py::test_chunked_and_decode_match_full[unaligned]": "[aligned_then_odd]",
    "tests/dsv4/test_cache_quant.py::test_model_switch_quantizes_the_cache_where_nemo_does":
        "test_cache_quant.py::test_bit_exact_with_nemo_random (the quantizers themselves)",
    "tests/dsv4/test_api.py::test_progress_counts_requests_rejected_mid_run":
        "test_schema.py::test_generate_refuses_each_bad_request_alone_and_keeps_serving",
    # kernels: whole-model interpret runs
    "tests/pallas_kernels/test_fp8_pages.py::test_kernel_fp8_paths[rec]": "[paged], [rec16]",
    # whole scripts as subprocesses (the main job's own test stays fast)
    "tests/experiments/test_serve.py::test_other_shipped_models_serve_by_name":
        "test_default_job_is_graded_and_caching_never_changes_the_answer",
    "tests/experiments/test_experiments.py::test_train_small_count": "test_training_steps_reduce_the_loss",
    "tests/cache/test_cache_bench.py::test_cache_bench_tiny":
        "the pieces it times: tests/cache/test_step_props.py (step_packed), test_manager.py (the manager's calls), "
        "tests/dsv4/test_engine_step.py (the fused step program)",
    "tests/dsv4/test_loading_pretrained.py::test_serve_main_job_on_a_checkpoint_dir":
        "test_loading_pretrained.py's load_pretrained tests",
    # engine-level variants whose features the fast tests named beside them cover (each line: the test that stays)
    "tests/dsv4/test_model_ragged.py::test_precision_modes": "tests/dsv4/test_cache_quant.py, test_fp8_pages.py",
    "tests/dsv4/test_model_ragged.py::test_step_shapes_follow_live_tables_not_max_len":
        "test_engine_step.py::test_compilation_is_bounded_and_counted (one table width for any pool size)",
    "tests/dsv4/test_model_cached.py::test_chunked_and_decode_match_full":
        "test_engine_step.py::test_engine_equals_forward_full[v4] (chunked prefill and decode == forward_full)",
    "tests/dsv4/test_v41_cached.py::test_v41_chunked_and_decode_match_full":
        "test_engine_step.py::test_engine_equals_forward_full[v41]",
    "tests/dsv4/test_engine.py::test_cache_never_changes_the_answer":
        "test_engine_step.py::test_engine_equals_forward_full[v41] (resumes, preemption)",
    "tests/dsv4/test_schema.py::test_generate_refuses_each_bad_request_alone_and_keeps_serving":
        "tests/dsv4/test_engine.py::test_bad_input_gets_a_clear_error_and_the_batch_goes_on (refused alone), "
        "test_schema.py's per-field checks",
    "tests/dsv4/test_api.py::test_tenants_and_sessionless_turns_keep_separate_histories":
        "tests/cache/test_specs_hashing.py (a tenant salts every block key), test_manager.py",
    "tests/dsv4/test_tiers_reload.py": "test_tiers_reload_sparse.py (disk reload through the engine), "
                                      "tests/cache/tiers (faults and corrupt records per backend)",
    "tests/dsv4/test_tiers_reload_sparse.py::test_reload_needs_only_the_resume_points_tail":
        "test_tiers_reload_writethrough.py (reload through the engine)",
    "tests/dsv4/test_nnx_model.py::test_engine_through_the_modules_gives_the_same_tokens":
        "test_apply_equals_forward_bit_for_bit[v4]",
    "tests/dsv4/test_export_checkpoint.py::test_text_and_chat_prompts_answer_through_generate_text":
        "test_round_trip_is_bit_for_bit; test_loading_transformers_generate.py (text and chat through generate_text)",
    "tests/dsv4/test_hf_parity.py::test_cached_path_matches_hf": "test_full_forward_matches_hf",
    "tests/cache/test_acceptance.py::test_session_switch_a1_a2_b_a3":
        "tests/dsv4/test_engine.py::test_hit_accounting_on_a_scripted_trace (hits after a session switch)",
    "tests/experiments/test_serve_export.py::test_exported_checkpoint_serves_text_and_chat_requests":
        "test_export_checkpoint.py::test_round_trip_is_bit_for_bit",
    "tests/experiments/test_notebook.py::test_notebook_runs": "test_notebook_matches_builder",
    "tests/experiments/test_experiments.py::test_shipped_headline_accuracy[v4_count]": "[v4_retrieval]",
    "tests/experiments/test_experiments.py::test_shipped_headline_accuracy[v41_retrieval]": "[v4_retrieval]",
    "tests/experiments/test_ablate_cache.py::test_release_order_head_first_vs_lru": "test_policy_invariants[lru]",
    "tests/pallas_kernels/test_sparse_attention.py::test_fp8_pools_match_dequant_then_reference[1]": "[2]",
    "tests/pallas_kernels/test_fp8_pages.py::test_kernel_fp8_paths[rec16]": "[paged]",
    "tests/dsv4/test_tiers_reload_writethrough.py":
        "test_tiers_reload_sparse.py (records written as blocks are computed, reloaded through the engine)",
    "tests/experiments/test_experiments.py::test_shipped_headline_accuracy[v4_retrieval]":
        "test_ablation_small[experiments.ablate_topk-topk] (accuracy of the shipped model at k = 8)",
    # engine configs that compile programs no other fast test shares
    "tests/dsv4/test_engine.py::test_sampled_outputs_survive_preemption":
        "test_engine_step.py::test_engine_equals_forward_full[v4] (5 preemptions, same tokens as forward_full)",
    "tests/dsv4/test_api.py::test_failed_admission_does_not_count_readmit_hits":
        "test_engine.py::test_hit_accounting_on_a_scripted_trace",
    "tests/dsv4/test_loading_transformers_generate.py::test_greedy_text_and_chat_match_transformers_generate":
        "test_tokenizer.py::test_bos_from_the_post_processor_matches_transformers, test_hf_parity.py",
    "tests/cache/tiers/test_extend_for_load.py::test_extend_for_load_allocates_full_blocks_and_only_the_swa_tails":
        "tests/dsv4/test_tiers_reload_sparse.py (reloads through the engine)",
    "tests/cache/test_manager.py::test_session_switch_a_b_a":
        "tests/dsv4/test_engine.py::test_hit_accounting_on_a_scripted_trace, test_hit_blocks_are_claimed_and_tables_"
        "consistent",
    "tests/cache/test_manager.py::test_hit_independent_of_other_allocation_count":
        "test_hit_blocks_are_claimed_and_tables_consistent",
    "tests/experiments/test_ablate_cache.py::test_policy_invariants[append_uncached]": "[lru]",
    "tests/experiments/test_ablate_cache.py::test_fifo_no_refresh_on_hit": "test_policy_invariants[lru]",
    # fourth cut (engines whose programs no other fast test shares, covered at another level)
    "tests/dsv4/test_engine.py::test_session_switch_hits_everything_up_to_the_last_boundary":
        "tests/cache/test_manager.py::test_hit_blocks_are_claimed_and_tables_consistent (the manager), "
        "test_engine.py::test_hit_accounting_on_a_scripted_trace (engine hits)",
    "tests/dsv4/test_engine_api_stop.py::test_stop_request_running_prefilling_and_waiting":
        "tests/experiments/test_serve_stop.py (stop strings end a running request through stop_request)",
    "tests/dsv4/test_nnx_model.py::test_apply_equals_forward_bit_for_bit":
        "test_nnx_model.py::test_apply_traces_to_the_same_program_as_forward (the same program: the same bits)",
    "tests/experiments/test_ablate_cache.py::test_lru_and_legacy_plumbing_equal_plain_manager":
        "test_ablate_cache.py::test_policy_invariants[lru]",
    # the composition matrix: the all-pairs rows on a mesh (8 host devices) and of V4.1 (the full product: `-m matrix`)
    "tests/dsv4/test_composition.py::test_all_pairs_mesh":
        "test_composition.py::test_all_pairs_one_device_v4 (every pair of the other four factors but mesh x each); "
        "mesh logic without devices: test_sharding.py::test_runner_slots_are_per_data_shard",
    # fifth cut: checks the composition matrix's default rows now make (tests/dsv4/test_composition.py)
    "tests/dsv4/test_engine_step.py::test_batch_invariant_alone_equals_batched":
        "test_composition.py::test_all_pairs_one_device_v4 (every row: a request alone == batched, bit for bit)",
    # measured to hold README command 2 under 8 minutes on 2 cores (each: what stays in the default tier)
    "tests/experiments/test_serve_tiers.py::test_a_second_process_reloads_the_first_ones_disk_records":
        "tests/dsv4/test_tiers_reload_sparse.py (disk records reloaded through the engine, same tokens), "
        "tests/cache/tiers (the disk backend across store instances)",
    "tests/experiments/test_serve.py::test_every_bad_jsonl_request_is_refused_alone_and_tenants_never_share":
        "tests/dsv4/test_engine.py::test_bad_input_gets_a_clear_error_and_the_batch_goes_on, test_serve.py's "
        "other refusals, test_serve_flags.py",
    "tests/test_row_bits_probe.py::test_the_probe_shows_what_the_cpu_does":
        "tests/dsv4/test_row_invariant.py (rows_dot: a row's bits at every live count and place), "
        "tests/pallas_kernels/test_row_dot.py (the row_dot kernel's row bits), test_row_bits_probe.py's verdict "
        "and suite-row checks",
    "tests/dsv4/test_nnx_model.py::test_engine_runs_the_modules_so_edits_change_its_output":
        "test_module_ragged_step_traces_to_the_functional_program (the engine's NNX step is the functional program)",
    "tests/cache/test_scenarios.py::test_concurrent_siblings_sharing_only_a_system_prompt":
        "tests/dsv4/test_engine_defer.py::test_followers_wait_only_for_the_leaders_shared_prefill",
    "tests/experiments/test_train_mtp.py::test_distillation_trains_the_block_and_leaves_the_backbone":
        "tests/experiments/test_experiments.py::test_training_steps_reduce_the_loss (the trainer), "
        "tests/dsv4/test_engine_spec.py::test_trained_drafts_give_the_same_greedy_tokens (the shipped trained block)",
    "tests/cache/test_scenarios.py::test_fanout_over_one_document_hits_the_document":
        "tests/cache/test_acceptance.py (hits over a shared document per group), test_manager.py::"
        "test_hit_blocks_are_claimed_and_tables_consistent",
    "tests/dsv4/test_tokenizer.py::test_generate_text_chat_and_stop_strings":
        "test_generate_text_bad_input_is_a_per_request_error (generate_text through the engine), "
        "test_save_load_encode_decode_template (the chat template), tests/dsv4/test_engine_api_stop.py (stops)",
    "tests/dsv4/test_engine_async.py::test_a_long_job_leaves_no_host_state_behind":
        "test_async_equals_sync[0-preempting] (every block back), tests/cache/test_host_tables_props.py",
    "tests/dsv4/test_hf_parity.py::test_no_topk_ties_and_same_selection_as_hf":
        "test_full_forward_matches_hf (the same selection, through the logits)",
    "tests/dsv4/test_v41_parity.py::test_engram_hash_matches_reference":
        "test_engram_hash_flash_constants, test_logits_match_nemo (Engram inside the model against NeMo's)",
    # a mesh engine compiles its own step program at XLA's default level (about a minute on 2 cores)
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_on_a_mesh":
        "test_invariant_logits_on_random_traces (the same traces and comparison on one device), "
        "tests/dsv4/test_sharding.py (the mesh step)",
    "tests/dsv4/test_row_invariant.py::test_forward_bits_ignore_the_flat_width[cpu_blocks]":
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces (one engine's step: a request's "
        "bits alone == batched, chunked, hit, preempted), test_row_invariant.py's op-level row-bit properties (any "
        "row count, any neighbours)",
    "tests/dsv4/test_model_ragged.py::test_hca_running_pool_equals_repool":
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v4] (decode steps' running HCA pools == "
        "forward_full's pooled windows, through the logits), tests/dsv4/test_window_pool_scan.py",
    # seventh cut: the default tier still took 11 min 51 s at f914fcc on the AMD EPYC machine; these moved too, each
    # with what stays in the default tier
    "tests/dsv4/test_engine_defer.py":
        "tests/cache/test_scenarios.py::test_siblings_sharing_only_a_system_prompt (siblings' hits at the manager)",
    "tests/cache/test_queued_admissions.py":
        "every engine test (each admission is queued): tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v4]",
    "tests/dsv4/test_tiers_admission.py::test_an_engine_reused_with_repeating_ids_equals_a_fresh_one":
        "test_tiers_admission.py::test_too_big_alone_is_refused_at_admission_with_or_without_tiers, tests/dsv4/test_tiers_precision.py (records through host and disk, bit for bit)",
    "tests/dsv4/test_engine.py::test_bad_input_gets_a_clear_error_and_the_batch_goes_on":
        "tests/dsv4/test_schema.py's per-field checks (each bad field one line), tests/experiments/test_serve.py's refusals",
    "tests/dsv4/test_engine.py::test_admitted_together_and_too_big_for_the_pool_are_all_rejected":
        "tests/cache/test_manager.py::test_out_of_blocks_is_reported_and_changes_nothing",
    "tests/dsv4/test_engine.py::test_pool_too_small_for_one_request_is_rejected_not_hung":
        "tests/dsv4/test_tiers_admission.py::test_too_big_alone_is_refused_at_admission_with_or_without_tiers, tests/cache/test_manager.py::test_out_of_blocks_is_reported_and_changes_nothing",
    "tests/dsv4/test_engine_step.py::test_one_transfer_each_way_per_step":
        "tests/cache/test_device_state.py (the manager holds no device array; its state moves in its cell)",
    "tests/pallas_kernels/test_dispatch.py::test_auto_validates_each_kernel_once_at_its_shapes":
        "test_dispatch.py::test_auto_falls_back_to_xla_once_with_one_warning (validation in a child process)",
    "tests/experiments/test_ablate_cache.py::test_policy_invariants[lru]": "[head_first]",
    "tests/dsv4/test_model_cached.py::test_padded_rows_do_not_touch_other_sequences":
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces[v4-bf16] (a request's bits ignore its neighbours)",
    "tests/pallas_kernels/test_model_integration.py::test_indexer_uses_the_fused_topk_kernel_when_kernels_are_on[v41]":
        "[v4]",
    "tests/experiments/test_ablation_cli.py::test_refresh_results_refuses_a_small_run":
        "test_ablation_cli.py's flag and replot tests",
    "tests/cache/test_scenarios.py::test_cold_concurrent_wave_never_fewer_than_vllm":
        "test_scenarios.py::test_siblings_sharing_only_a_system_prompt",
    "tests/cache/test_scenarios.py::test_batched_admission_one_device_call":
        "tests/cache/test_step_props.py::test_apply_step_matches_reference (the packed step, admissions included)",
    "tests/dsv4/test_export_checkpoint.py::test_cli_writes_and_refuses_to_overwrite":
        "test_export_checkpoint.py::test_round_trip_is_bit_for_bit",
    "tests/dsv4/test_nnx_model.py::test_apply_traces_to_the_same_program_as_forward[v41]": "[v4]",
# sixth cut: README command 2 within 8 minutes on the slower 2-core machine CI runs on (an AMD EPYC about half the
    # earlier machine's speed: the tier took 12 min 52 s in CI at 3b6ff25). Each: what stays in the default tier.
    "tests/dsv4/test_spec_reservation.py":
        "tests/dsv4/test_engine_spec.py::test_trained_drafts_give_the_same_greedy_tokens (drafts with rejections, "
        "preemption and prefix hits: the same greedy tokens, the reservation and the kept blocks exercised)",
    "tests/dsv4/test_composition.py::test_all_pairs_one_device_v4":
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces[v4-bf16] (a request alone == "
        "batched, chunked, hit, preempted), tests/pallas_kernels/test_fp8_pages.py (FP8 pages), "
        "tests/pallas_kernels/test_model_integration.py (interpret kernels in the model)",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused_every_variant[v4-bf16]":
        "test_tiers_admission.py::test_too_big_alone_is_refused_at_admission_with_or_without_tiers, "
        "test_an_engine_reused_with_repeating_ids_equals_a_fresh_one (more draws of the same engines)",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused":
        "test_tiers_admission.py::test_an_engine_reused_with_repeating_ids_equals_a_fresh_one[True] (tiers, hits, "
        "the same bits), test_too_big_alone_is_refused_at_admission_with_or_without_tiers (the refusal rule), "
        "tests/cache/tiers (the Redis tier)",
    "tests/dsv4/test_dspark_engine.py::test_drafts_never_change_greedy_tokens":
        "tests/dsv4/test_dspark_parity.py::test_draft_matches_nemo_on_given_features (the drafter), "
        "tests/dsv4/test_engine_spec.py::test_trained_drafts_give_the_same_greedy_tokens (drafts in the engine)",
    "tests/dsv4/test_engine_async.py::test_async_equals_sync":
        "tests/dsv4/test_engine_spec.py::test_trained_drafts_give_the_same_greedy_tokens (the async engine == its "
        "greedy reference), test_engine_async.py::test_stop_token_seen_one_step_late_is_not_emitted",
    "tests/experiments/test_serve_flags.py::test_every_flag_mistake_is_one_line_exit_2_before_the_model_loads":
        "test_serve_flags.py::test_every_flag_mistake_is_a_one_line_flag_error_from_the_checks (the same checks, "
        "in process)",
    "tests/experiments/test_experiments.py::test_training_steps_reduce_the_loss":
        "test_experiments.py's task and checkpoint tests; the shipped trained checkpoints load and answer",
    "tests/benchmarks/test_budget_width.py::test_the_cpu_step_fills_its_loop_buffers_without_copies":
        "test_budget_width.py::test_the_tiny_step_keeps_its_per_token_work_in_the_live_loops (the compiled step's "
        "structure)",
    "tests/dsv4/test_engine.py::test_hit_accounting_on_a_scripted_trace":
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v4] (prefix hits and resumes == "
        "forward_full), tests/cache/test_manager.py (hit accounting in the manager)",
    "tests/dsv4/test_tokenizer.py::test_generate_text_bad_input_is_a_per_request_error":
        "test_tokenizer.py's encode / decode / template tests, tests/dsv4/test_engine.py::"
        "test_bad_input_gets_a_clear_error_and_the_batch_goes_on (a bad request refused alone)",
    "tests/dsv4/test_flash_shapes.py::test_v4_flash_cache_shapes_after_a_prefill":
        "test_flash_shapes.py::test_v4_flash_parameter_count and test_v4_flash_layer_plan (V4-Flash shapes), "
        "tests/dsv4/test_sharding.py (every Flash parameter and cache array has logical axes)",
    "tests/dsv4/test_row_invariant.py::test_in_place_updates_and_unwritten_buffers_keep_the_bits":
        "test_row_invariant.py's row-bit properties (any row count, any neighbours)",
    "tests/dsv4/test_row_invariant.py::test_expert_layout_is_a_stable_sort_of_the_live_pairs":
        "test_row_invariant.py::test_grouped_experts_row_bits_ignore_batch and test_grouped_experts_runs_only_live_"
        "blocks (the layout inside the experts)",
    "tests/experiments/test_experiments.py::test_ablation_small[experiments.ablate_topk-topk]":
        "tests/experiments/test_ablation_cli.py (every ablation's flags and its table)",
    "tests/experiments/test_discriminating_ablations.py::test_full_replay_is_exact_and_a_short_one_is_not":
        "test_discriminating_ablations.py::test_indexer_recall_small and test_key_formats_lose_in_order_and_fp32_"
        "recall_is_one",
    "tests/experiments/test_serve.py::test_default_job_is_graded":
        "the main job itself (README command 1, CI's first step), test_serve.py's refusals",
    "tests/dsv4/test_engine_api_stop.py::test_an_id_in_use_is_a_per_request_error":
        "tests/dsv4/test_engine.py::test_bad_input_gets_a_clear_error_and_the_batch_goes_on",
    "tests/dsv4/test_sharding.py::test_mesh_step_tables_travel_device_to_device":
        "test_sharding.py::test_engine_table_rows_are_per_data_shard (the mesh step's tables)",
    "tests/dsv4/test_handoff.py":
        "tests/dsv4/test_tiers_precision.py (the records a handoff carries, bit for bit), tests/cache/tiers",
    "tests/dsv4/test_sharding.py::test_experts_per_expert_shard_keep_row_bits_on_kernel_and_loop":
        "test_sharding.py::test_moe_without_mesh_is_the_unsharded_path, tests/dsv4/test_row_invariant.py "
        "(the experts' row bits)",
    "tests/cache/test_acceptance.py::test_hybrid_limiting_group[0-swa-24-0]": "test_hybrid_limiting_group's other rows",
    "tests/dsv4/test_nnx_model.py::test_module_ragged_step_traces_to_the_functional_program":
        "test_nnx_model.py::test_apply_traces_to_the_same_program_as_forward (the modules trace to the functional "
        "program)",
    "tests/cache/test_inplace.py::test_apply_step_updates_in_place": "test_inplace.py::test_single_ops_update_in_place",
    "tests/cache/test_device_state.py::test_a_manager_holds_no_device_array_and_runs_through_its_cell":
        "test_device_state.py::test_the_cell_is_where_the_state_changes",
    "tests/dsv4/test_model_ragged.py::test_side_by_side_compressors_equal_each_alone":
        "tests/dsv4/test_window_pool_scan.py (the compressors' pools)",
    "tests/dsv4/test_tiers_precision.py::test_blocks_on_a_mesh_bit_for_bit":
        "test_tiers_precision.py::test_blocks_through_host_and_disk_bit_for_bit",
}

# The default tier's 8-minute budget, the eighth cut: parametrizations whose siblings stay in the default tier (each
# row here compiles its own programs or starts its own process).
_CLI = "tests/experiments/test_ablation_cli.py::test_help_lists_every_flag_the_docstring_names"
SLOW.update({f"{_CLI}[{script}]": "[ablate_eviction] and [cache_bytes] (the same check on a script that writes "
             "results and on one that does not)"
             for script in ("ablate_topk", "ablate_window", "ablate_retention", "tiers_workload", "precision",
                            "v41_quant_cache_parity", "train", "ablate_spec", "ablate_multikey", "ablate_resume",
                            "ablate_indexer_recall")})
_PLOTS = "tests/experiments/test_ablation_plots.py::test_committed_results_plot_reads"
SLOW.update({f"{_PLOTS}[{row}]": "[ablate_topk-topk-k] and [ablate_eviction-eviction-num_full_blocks]"
             for row in ("ablate_topk-topk_v4_count-k", "ablate_topk-topk_v41_retrieval-k",
                         "ablate_window-window-window", "ablate_retention-retention-retention_interval",
                         "ablate_spec-spec-k")})
_FALLBACK = "tests/pallas_kernels/test_dispatch.py::test_auto_falls_back_to_xla_once_with_one_warning"
SLOW.update({f"{_FALLBACK}[{row}]": "its [wrong_sparse], [raising_topk] and [crashing_sparse] rows (the same fallback "
             "after a failed child validation)"
             for row in ("sparse_attention-nondeterministic_sparse-nondeterministic: two runs on the same inputs "
                         "differ-None", "sparse_attention-hanging_sparse-timed out after 5 s-5")})
_ROW_DOT = "tests/pallas_kernels/test_row_dot.py::test_a_row_keeps_its_bits_whatever_the_batch"
SLOW.update({f"{_ROW_DOT}[{row}]": "[bf16-4] and [fp32-1]" for row in ("bf16-1", "bf16-2", "fp32-2", "fp32-4")})
SLOW["tests/pallas_kernels/test_v4_flash_shapes.py::test_v4_flash_batch1_decode_many_splits"] = (
    "test_v4_flash_shapes.py::test_fp8_d512_every_storage_path[paged] (the FP8 paged pool at V4-Flash's width), "
    "tests/pallas_kernels/test_sparse_attention.py::test_lengths_at_block_boundaries_with_many_splits")


# node id -> what covers the feature in the tiers CI runs (each entry: on demand, `pytest -n 2 -m matrix tests`)
ON_DEMAND = {
    "tests/dsv4/test_composition.py::test_all_pairs_mesh[v41]":
        "test_all_pairs_mesh[v4] (the mesh rows), test_all_pairs_one_device_v41's rows (V4.1 through the same engine "
        "code)",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused_on_a_mesh":
        "test_a_request_that_fits_is_never_refused[redis] (one device), "
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] (a mesh with pools over data, tiers that demote and "
        "reload)",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused_every_variant[v41-fp8]":
        "test_a_request_that_fits_is_never_refused_every_variant[v4-bf16], "
        "test_a_request_that_fits_is_never_refused[redis]",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused_every_variant[v41-bf16]":
        "test_a_request_that_fits_is_never_refused_every_variant[v4-bf16], "
        "test_a_request_that_fits_is_never_refused[redis]",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused_every_variant[v4-fp8]":
        "test_a_request_that_fits_is_never_refused_every_variant[v4-bf16], "
        "test_a_request_that_fits_is_never_refused[redis]",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused[local]":
        "test_a_request_that_fits_is_never_refused[redis] (host + disk + Redis)",
    "tests/dsv4/test_tiers_admission.py::test_a_request_that_fits_is_never_refused[mooncake]":
        "test_a_request_that_fits_is_never_refused[redis] (a remote tier), "
        "tests/dsv4/test_tiers_reload.py::test_reload_gate_mooncake[v4] (reloads from Mooncake through the engine)",
    "tests/dsv4/test_sharding.py::test_engine_with_one_kv_pool_per_data_shard":
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] (every mesh row splits the pools over data), "
        "test_engine_table_rows_are_per_data_shard",
    "tests/dsv4/test_sharding.py::test_kv_latent_split_by_feature_matches_one_device":
        "the replicated latent on a mesh: test_engine_on_mesh_same_tokens_with_prefix_hits",
    "tests/dsv4/test_sharding.py::test_scanned_layer_groups_step_matches_the_unrolled_step":
        "the unrolled step everywhere; the scan serves only the sizing benchmark",
    "tests/dsv4/test_dspark_engine.py::test_drafts_on_or_off_same_bits[dspark-fp8]":
        "[dspark-bf16], tests/dsv4/test_engine_spec.py::test_drafts_compose_with_tiers_and_kv_precision (drafts at "
        "FP8 KV)",
    "tests/dsv4/test_dspark_engine.py::test_drafts_on_or_off_same_bits[mtp-bf16]":
        "[dspark-bf16] (the same comparison), tests/dsv4/test_engine_spec.py (V4's MTP drafts never change tokens)",
    "tests/dsv4/test_dspark_engine.py::test_handoff_carries_the_draft_state":
        "test_tier_reloads_carry_the_draft_state (the draft state in the records), tests/dsv4/test_handoff.py",
    "tests/dsv4/test_dspark_engine.py::test_drafts_never_change_greedy_tokens[False]":
        "[True] (async) and test_served_drafts_equal_drafts_from_scratch[preempting] (synchronous steps)",
    "tests/experiments/test_discriminating_ablations.py::test_retention_multiturn_small":
        "test_discriminating_ablations.py::test_multiturn_traces_resume_where_they_say and "
        "test_full_replay_is_exact_and_a_short_one_is_not, tests/experiments/test_ablate_cache.py (retention through "
        "the manager)",
    "tests/experiments/test_discriminating_ablations.py::test_resume_small":
        "test_discriminating_ablations.py::test_full_replay_is_exact_and_a_short_one_is_not",
    "tests/cache/test_acceptance.py::test_session_switch_a1_a2_b_a3[False]": "[True]",
    "tests/experiments/test_ablate_cache.py::test_ablate_eviction_small":
        "test_policy_invariants[lru] and [head_first]",
    "tests/experiments/test_ablate_cache.py::test_ablate_retention_small":
        "tests/cache/test_manager.py (retention checkpoints in the manager)",
    "tests/experiments/test_ablate_cache.py::test_policy_invariants[legacy_dense]": "[lru]",
    "tests/experiments/test_ablate_cache.py::test_policy_invariants[fifo]": "[lru]",
    "tests/dsv4/test_v41_cached.py::test_v41_chunked_and_decode_match_full[odd_prefixes]": "[aligned_then_odd]",
    "tests/dsv4/test_tiers_reload.py::test_reload_gate_mooncake[v41]": "[v4]",
    "tests/experiments/test_experiments.py::test_train_small": "test_train_small_count, test_train_small_motif",
    "tests/dsv4/test_engine.py::test_cache_never_changes_the_answer[0]": "[1]",
    "tests/dsv4/test_engine_spec.py::test_drafts_compose_with_tiers_and_kv_precision[fp32-fp32]": "[fp8-bf16]",
    "tests/experiments/test_serve.py::test_caching_never_changes_the_main_jobs_answers":
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full (hits and resumes == forward_full), the main "
        "job (CI's first step: graded, hits)",
    "tests/experiments/test_experiments.py::test_ablation_small[experiments.ablate_window-window]":
        "[experiments.ablate_topk-topk]",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_every_variant[v4-fp8]":
        "[v41-bf16], test_invariant_logits_on_random_traces[v4-bf16], tests/dsv4/test_composition.py's FP8 rows "
        "(alone == batched)",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_every_variant[v41-fp8]":
        "[v41-bf16], test_invariant_logits_with_drafts_and_tier_reloads[v4-bf16]",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_with_drafts_and_tier_reloads[v41-fp8]": "[v4-bf16]",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_on_a_mesh_every_variant":
        "test_invariant_logits_on_random_traces_on_a_mesh (V4 bf16), "
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4]",
    "tests/dsv4/test_invariance_props.py::test_invariant_logits_with_tier_reloads_on_a_mesh":
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] (mesh rows with tiers that demote and reload: alone "
        "== batched), test_invariant_logits_with_drafts_and_tier_reloads[v4-bf16] (one device)",
    "tests/dsv4/test_model_ragged.py::test_ragged_random_mix_matches_full[v41-0]": "[v4-0]",
    "tests/dsv4/test_model_ragged.py::test_swa_table_cut_to_the_window_is_bitwise_the_same[v41]": "[v4]",
    "tests/dsv4/test_model_ragged.py::test_resume_from_checkpoint_equals_scratch[v41]": "[v4]",
    "tests/dsv4/test_model_ragged.py::test_paged_indexer_equals_reference_path[v41]": "[v4]",
    "tests/dsv4/test_sharding.py::test_sharded_forward_matches_one_device[v41]": "[v4]",
    "tests/dsv4/test_handoff.py::test_decode_resumes_where_prefill_stopped[v41]": "[v4]",
    "tests/dsv4/test_handoff.py::test_decode_resumes_where_prefill_stopped[v4_mtp]": "[v4]",
    "tests/dsv4/test_handoff.py::test_a_corrupt_or_missing_record_stores_nothing[v41]": "[v4]",
    "tests/dsv4/test_handoff.py::test_a_corrupt_or_missing_record_stores_nothing[v4_mtp]": "[v4]",
    "tests/dsv4/test_handoff.py::test_a_preempted_decode_request_adopts_its_tail_again[v41]": "[v4]",
    "tests/dsv4/test_handoff.py::test_a_preempted_decode_request_adopts_its_tail_again[v4_mtp]": "[v4]",
    "tests/dsv4/test_row_invariant.py::test_forward_bits_ignore_the_flat_width[cpu_blocks_two_live]": "[cpu_blocks]",
    "tests/dsv4/test_row_invariant.py::test_forward_bits_ignore_the_flat_width[gpu_blocks]":
        "[cpu_blocks] (the GPU's 128 rows differ only in the block shape), "
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_at_a_gpus_row_blocks",
    "tests/dsv4/test_row_invariant.py::test_dead_rows_of_loop_buffers_reach_no_live_row_on_the_kernels[gpu]": "[cpu]",
    "tests/dsv4/test_nnx_model.py::test_apply_equals_forward_bit_for_bit[v41]": "[v4]",
    "tests/dsv4/test_engine.py::test_v41_cache_never_changes_the_answer":
        "test_cache_never_changes_the_answer[1] (V4), "
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v41]",
    "tests/dsv4/test_engine_kernels.py::test_engine_interpret_kernels_give_the_xla_tokens":
        "tests/dsv4/test_composition.py's interpret rows (greedy tokens == a cold XLA engine)",
    "tests/pallas_kernels/test_model_integration.py::test_small_model_logits_match_between_backends":
        "test_model_integration.py::test_tiny_model_logits_match_between_backends",
    "tests/dsv4/test_tiers_reload.py::test_reload_gate_every_tier":
        "tests/dsv4/test_tiers_reload_sparse.py (disk reloads through the engine), test_reload_gate_mooncake[v4], "
        "tests/experiments/test_serve_tiers.py (a second process reloads disk and Redis records), tests/cache/tiers",
    "tests/dsv4/test_tiers_reload.py::test_two_engines_in_two_processes_share_redis":
        "tests/experiments/test_serve_tiers.py::test_a_second_process_reloads_from_redis",
    "tests/dsv4/test_dspark_engine.py::test_served_drafts_equal_drafts_from_scratch":
        "test_drafts_on_or_off_same_bits[dspark-bf16] and test_drafts_never_change_greedy_tokens[True] (DSpark drafts "
        "through the engine with prefix hits)",
    "tests/dsv4/test_dspark_engine.py::test_tier_reloads_carry_the_draft_state":
        "test_drafts_on_or_off_same_bits[dspark-bf16], "
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_with_drafts_and_tier_reloads[v4-bf16] (drafts "
        "across tier reloads, bit for bit)",
    "tests/cache/test_queued_admissions.py::test_queued_admissions_match_the_standalone_call":
        "test_queued_admissions_need_no_call_of_their_own (default tier)",
    "tests/experiments/test_discriminating_ablations.py::test_multikey_small":
        "test_discriminating_ablations.py::test_multikey_task_answers_the_fraction_of_slots_holding_the_key and "
        "test_key_formats_lose_in_order_and_fp32_recall_is_one (default tier)",
    "tests/dsv4/test_engine_spec.py::test_trained_drafts_synchronous":
        "test_trained_drafts_give_the_same_greedy_tokens (the async engine; sync is the reference it equals)",
    "tests/benchmarks/test_plain_step.py":
        "the plain step serves only the step benchmarks; tests/benchmarks/test_step_cost.py (their tables print)",
    "tests/dsv4/test_composition.py::test_all_pairs_one_device_v4[one-fp32-notiers-xla]":
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v4] (the fp32 XLA engine == forward_full), "
        "the two other one-device V4 rows",
    "tests/dsv4/test_composition.py::test_all_pairs_one_device_v41":
        "the one-device V4 rows (the same engine code), "
        "tests/dsv4/test_engine_step.py::test_engine_equals_forward_full[v41], "
        "tests/dsv4/test_invariance_props.py::test_invariant_logits_on_random_traces_every_variant[v41-bf16]",
    "tests/test_gpu_suite.py::test_the_whole_suite_dry_runs_on_the_cpu":
        "test_every_kernel_program_of_the_suite_lowers_for_a_gpu_at_its_real_shapes and test_kernels_bench_small_runs "
        "(slow tier), the suite's budget, report and flag tests (default tier); a session lent a GPU runs it "
        "first (over 11 minutes of a worker on the AMD EPYC machine, at XLA's default level)",
    "tests/dsv4/test_sharding.py::test_engine_on_mesh_same_tokens_with_prefix_hits":
        "tests/dsv4/test_composition.py::test_all_pairs_mesh[v4] (mesh engines with prefix hits: tokens == a cold "
        "one-device engine), test_sharding.py::test_engine_table_rows_are_per_data_shard",
}

"""The CUDA/NCCL double's rules as data: each fact the double enforces (a refusal, a violation it records, a wait
or hang it models, a device check), the torch/CUDA/NCCL source it mirrors, the CPU test that checks the double
enforces it, and the GPU-tier test (`pytest -m cuda`) that checks the same fact on a real GPU, or why there is
none. tests/test_double_rules.py keeps the node ids honest (they exist; GPU ones are marked `cuda`, CPU ones are
not). `python -m tests.fakes.rules` prints the table and the count (issue 38, "Numbers").

The rules stay in the fakes' own code and docstrings; this file only points at them (`where`) so that the fakes
need not carry ids. Facts that are the same on the double are one rule (a refusal and its variants)."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    id: str  # short and stable
    fact: str  # one line, as a GPU has it
    where: str  # the fake that enforces it (file: function)
    source: str  # what it mirrors (torch/CUDA: file and function; NCCL: doc page or src/ path)
    cpu_test: str  # pytest node id of the test that checks the double enforces it
    gpu_test: str | None  # node id of a `cuda`-marked test of the same fact on a real GPU
    why_no_gpu_test: str | None = None  # required when gpu_test is None


_CONTRACT = "tests/test_nccl_contract.py"
_MORE = "tests/test_nccl_contract_rules.py"
_GPU = "tests/cuda/test_double_rules_gpu.py"
_CHECKS = "tests/test_double_rule_checks.py"

_HANG = "a hang: NCCL's kernels (or its host call) wait for ever, which only a separate process killed after a timeout could show"
_TWO_GPUS = "needs two GPUs"

RULES: tuple[Rule, ...] = (
    # -- NCCL: communicators (fake_nccl.py) -------------------------------------------------------------------------
    Rule(
        "nccl-init-waits-for-all",
        "ncclCommInitRank blocks until every rank of the unique id has joined, with no timeout",
        "fake_nccl.py: FakeFabric.join",
        "nccl.h (ncclCommInitRank); src/init.cc (bootstrap of ncclCommInitRankDev)",
        "tests/test_nccl_double.py::test_a_blocking_init_whose_peers_never_join_would_wait_for_ever",
        f"{_GPU}::test_a_blocking_init_whose_peer_never_joins_waits_for_ever",
    ),
    Rule(
        "nccl-duplicate-gpu",
        "two ranks of one communicator on one GPU fail the init with ncclInvalidUsage (Duplicate GPU detected)",
        "fake_nccl.py: FakeFabric.join, join_later; FakeNccl.comm_init_all",
        "src/init.cc (initTransportsRank: 'Duplicate GPU detected')",
        f"{_CONTRACT}::test_two_ranks_of_one_communicator_on_one_device_are_refused[double]",
        f"{_CONTRACT}::test_two_ranks_of_one_communicator_on_one_device_are_refused[nccl]",
    ),
    Rule(
        "nccl-init-rank-range",
        "a rank outside [0, nranks) fails ncclCommInitRank with ncclInvalidArgument",
        "fake_nccl.py: FakeNccl.comm_init_rank, comm_init_rank_config",
        "src/init.cc (ncclCommInitRankDev: 'Invalid rank requested')",
        f"{_MORE}::test_a_rank_outside_the_communicator_is_an_invalid_argument_at_init[double]",
        f"{_MORE}::test_a_rank_outside_the_communicator_is_an_invalid_argument_at_init[nccl]",
    ),
    Rule(
        "nccl-freed-communicator",
        "a communicator freed by ncclCommAbort or ncclCommDestroy must never be passed to NCCL again",
        "fake_nccl.py: FakeNccl._check_usable (a violation)",
        "src/init.cc (commReclaim frees the communicator)",
        "tests/test_nccl_double.py::test_abort_ends_this_ranks_pending_kernel_and_freed_communicators_fail_loudly",
        None,
        "undefined behaviour in NCCL (a freed pointer): it may crash the process or pass; nothing to assert",
    ),
    Rule(
        "nccl-one-thread-per-device",
        "one host thread at a time inside NCCL on a device (a group holds it to its end; abort with no other "
        "thread inside)",
        "fake_nccl.py: FakeNccl._enter_device (a violation)",
        "NCCL user guide usage/threadsafety.html, usage/communicators.html 'Fault Tolerance'; "
        "src/misc/strongstream.cc (NCCL_LAUNCH_RACE_FATAL, 2.26+)",
        "tests/test_nccl_double.py::test_two_threads_issuing_on_one_device_at_once_is_a_violation",
        None,
        "a race: NCCL reports it only when two threads' launches overlap in time, so no run can show it on demand",
    ),
    Rule(
        "nccl-stream-of-another-device",
        "an NCCL call on a stream of another device than the communicator's fails (ncclUnhandledCudaError)",
        "fake_nccl.py: FakeNccl._check_stream",
        "CUDA C Programming Guide 'Stream and Event Behavior'; src/enqueue.cc (launch with the comm's device current)",
        "tests/test_nccl_double.py::test_a_stream_of_another_device_is_refused",
        None,
        f"{_TWO_GPUS}, and where the failure surfaces (the call, the group end or the asynchronous error) is not "
        "established from NCCL's source; a world-1 collective is a copy (src/enqueue.cc, ncclLaunchOneRank)",
    ),
    Rule(
        "nccl-device-memory",
        "NCCL's buffers are device memory of the communicator's GPU (a host buffer or another GPU's is refused "
        "with pointer checks on, else faults the kernel)",
        "fake_nccl.py: FakeNccl._memory (a violation)",
        "src/misc/argcheck.cc (CudaPtrCheck, NCCL_CHECK_POINTERS)",
        "tests/test_nccl_double.py::test_a_host_buffer_or_one_on_another_gpu_is_a_violation",
        None,
        "with NCCL's default (no pointer checks) a host buffer is an illegal-address fault, sticky for the whole "
        "process's CUDA context: not safe in the GPU tier",
    ),
    # -- NCCL: groups and arguments ---------------------------------------------------------------------------------
    Rule(
        "nccl-group-nesting",
        "ncclGroupStart/End nest per thread; an end without a start is ncclInvalidUsage",
        "fake_nccl.py: FakeNccl.group_start, group_end",
        "src/group.cc (ncclGroupEndInternal: 'ncclGroupEnd: not in a group call.'); usage/groups.html",
        f"{_CONTRACT}::test_groups_nest_and_an_end_without_a_start_is_invalid_usage[double]",
        f"{_CONTRACT}::test_groups_nest_and_an_end_without_a_start_is_invalid_usage[nccl]",
    ),
    Rule(
        "nccl-group-launches-at-end",
        "a group's operations are launched at its outermost end (an operation outside a group is a group of one)",
        "fake_nccl.py: FakeNccl._queue, group_end",
        "usage/groups.html; src/group.cc (groupLaunch)",
        "tests/test_nccl_double.py::test_operations_of_a_group_launch_at_its_end",
        f"{_GPU}::test_a_groups_operations_are_launched_at_its_end",
    ),
    Rule(
        "nccl-root-peer-range",
        "a root or peer outside [0, nranks) is ncclInvalidArgument, at the call",
        "fake_nccl.py: FakeNccl._check_root",
        "src/misc/argcheck.cc (ArgsCheck: 'invalid root')",
        f"{_CONTRACT}::test_a_root_outside_the_communicator_is_an_invalid_argument[double]",
        f"{_CONTRACT}::test_a_root_outside_the_communicator_is_an_invalid_argument[nccl]",
    ),
    Rule(
        "nccl-reduction-ops",
        "ncclRedOp_t is ncclSum..ncclAvg (0-4); any other value without a ncclRedOpCreatePreMulSum handle is "
        "ncclInvalidArgument",
        "fake_nccl_math.py: check_op",
        "nccl.h (ncclRedOp_t); src/misc/argcheck.cc (ArgsCheck: 'invalid reduction operation', 'unknown to this "
        "communicator')",
        f"{_MORE}::test_a_reduction_nccl_does_not_have_is_an_invalid_argument[double]",
        f"{_MORE}::test_a_reduction_nccl_does_not_have_is_an_invalid_argument[nccl]",
    ),
    Rule(
        "nccl-data-types",
        "a dtype without an ncclDataType_t (a complex one) is refused before NCCL is called (bfloat16 only from "
        "2.10; bool moves as uint8). (The double also refuses uint32, uint64 and fp8, which NCCL has: nccl.h, fp8 "
        "from 2.24)",
        "fake_nccl.py: FakeNccl._check_buffers (NCCL_DTYPES)",
        "nccl.h (ncclDataType_t); threadpar/comm/nccl/library.py: data_type",
        f"{_MORE}::test_a_dtype_nccl_has_no_type_for_is_refused_before_the_call[double]",
        f"{_MORE}::test_a_dtype_nccl_has_no_type_for_is_refused_before_the_call[nccl]",
    ),
    Rule(
        "nccl-avg",
        "ncclAvg on floats multiplies each input by 1/n rounded to the data type before the sum; on integers it "
        "divides the sum by n, truncating",
        "fake_nccl_math.py: _pre_mul_sum, _reduce",
        "src/enqueue.cc (hostToDevRedOp: ncclDevPreMulSum, ncclDevSumPostDiv); src/device/reduce_kernel.h",
        f"{_MORE}::test_avg_over_three_ranks_is_nccls_premultiplied_sum[double]",
        f"{_MORE}::test_avg_over_three_ranks_is_nccls_premultiplied_sum[nccl]",
    ),
    Rule(
        "nccl-mixed-blocking-group",
        "the double: blocking and nonblocking communicators in one group are ncclInvalidUsage",
        "fake_nccl.py: FakeNccl.group_end",
        "src/group.cc (ncclAsyncLaunch: 'Blocking and nonblocking communicators are not allowed in the same group.')",
        f"{_CHECKS}::test_the_double_refuses_blocking_and_nonblocking_communicators_in_one_group",
        None,
        "NCCL's source (2.23-2.30) disagrees: the check is in ncclAsyncLaunch, for asynchronous jobs (inits, "
        "connections) only, and returns ncclInvalidArgument; collectives of mixed communicators in one group are "
        "not refused (src/include/group.h, ncclGroupCommJoin sets ncclGroupBlocking from the last one). The "
        "double's rule needs correcting before a GPU test can agree with it",
    ),
    # -- NCCL: the device waits for the peers ----------------------------------------------------------------------
    Rule(
        "nccl-stream-waits-for-peers",
        "an NCCL call returns at once; its kernel (a collective's, a send's) completes only once every peer's "
        "matching part runs: the stream waits, not the host",
        "fake_device.py: advance, _run_kernel; fake_nccl.py: FakeNccl._launch",
        "nccl.h ('blocking for the GPU'); usage/p2p.html",
        "tests/test_nccl_double.py::test_a_call_returns_at_once_and_its_stream_waits_for_the_peers",
        f"{_GPU}::test_a_collective_returns_at_once_and_its_stream_waits_for_the_peer",
    ),
    Rule(
        "nccl-p2p-order",
        "ncclSend/ncclRecv match per (communicator, peer) in issue order, with the same count and type",
        "fake_nccl.py: FakeFabric.point_to_point",
        "usage/p2p.html",
        "tests/test_nccl_double.py::test_sends_and_receives_match_per_peer_in_order_and_must_agree_on_size",
        f"{_MORE}::test_sends_to_one_peer_match_its_receives_in_issue_order[nccl]",
    ),
    Rule(
        "nccl-send-waits-for-receive",
        "a send returns at once and blocks its stream until its receive runs (a GPU may complete a small one "
        "into NCCL's buffers without it: the double is the stricter)",
        "fake_device.py: _run_kernel (a P2pOp runs once both parts are at their streams' heads)",
        "nccl.h (ncclSend: 'blocking for the GPU'); usage/p2p.html",
        "tests/test_nccl_double.py::test_a_send_blocks_its_stream_until_the_receive_runs",
        f"{_GPU}::test_a_send_blocks_its_stream_until_the_receive_runs",
    ),
    Rule(
        "nccl-crossing-sends-hang",
        "two ranks that each send, then receive, as separate launches on one communicator wait for each other "
        "for ever",
        "fake_device.py: run_to (a cycle is a HangError)",
        "nccl.h; src/enqueue.cc (ncclLaunchPrepare: a communicator's launches run in issue order)",
        "tests/test_nccl_double.py::test_a_send_blocks_its_stream_until_the_receive_runs",
        None,
        f"{_TWO_GPUS}; {_HANG}; and with messages that fit NCCL's buffers (the double's test sends 4 floats) a "
        "GPU may complete both sends without their receives, so the double reports a hang a GPU may not have",
    ),
    Rule(
        "nccl-launch-order",
        "a communicator's launches run one after another in issue order, whatever streams they were issued on",
        "fake_nccl.py: FakeNccl._launch (lanes)",
        "src/enqueue.cc (ncclLaunchPrepare, ncclLaunchFinish: the comm's deviceStream)",
        "tests/test_nccl_double.py::test_a_communicators_launches_run_in_issue_order_whatever_their_streams",
        f"{_GPU}::test_a_communicators_launches_run_in_issue_order_whatever_their_streams",
    ),
    Rule(
        "nccl-cross-communicator-order",
        "ranks that issue two communicators' operations in opposite orders on one stream hang",
        "fake_device.py: run_to (a cycle of kernels)",
        "nccl.h (kernels block until their peers run); CUDA stream order",
        "tests/test_nccl_double.py::test_collectives_of_two_groups_in_opposite_orders_on_two_ranks_are_a_hang",
        None,
        f"{_TWO_GPUS}; {_HANG}",
    ),
    Rule(
        "nccl-matching-collectives",
        "every rank issues the same collectives (count, type, op, root) in the same order; NCCL does not check",
        "fake_nccl.py: FakeFabric.collective (the double fails the operation)",
        "nccl.h; usage/collectives.html",
        "tests/test_nccl_double.py::test_collectives_that_differ_across_ranks_fail_their_kernels",
        None,
        "NCCL does not check it: a mismatch hangs or corrupts data (undefined), so a GPU has nothing to refuse",
    ),
    Rule(
        "nccl-buffer-sizes",
        "all_gather's output and reduce_scatter's input hold nranks x count elements; the root of ncclReduce "
        "passes a recvbuff",
        "fake_nccl_math.py: _sizes",
        "nccl.h (ncclAllGather, ncclReduceScatter, ncclReduce)",
        "tests/test_nccl_double.py::test_buffers_too_small_for_the_communicators_size_fail_the_kernel",
        None,
        "an overrun or a null recvbuff is undefined behaviour (an illegal address fault is sticky for the process)",
    ),
    Rule(
        "nccl-in-place",
        "send and receive buffers overlap only as usage/inplace.html defines (all_gather's input at rank x count "
        "of its output; reduce_scatter's output at rank x count of its input)",
        "fake_nccl_math.py: _in_place_offset",
        "usage/inplace.html",
        "tests/test_fake_modes.py::test_nccls_in_place_offset_rule",
        None,
        "another overlap is undefined (NCCL reads what it already overwrote), not a refusal",
    ),
    # -- NCCL: connections, nonblocking communicators, failures ------------------------------------------------------
    Rule(
        "nccl-connect-on-first-use",
        "point-to-point connections (and with NCCL_RUNTIME_CONNECT=1, 2.22+, a collective algorithm's) are made "
        "at first use, blocking the host inside the group end until the peers issue their parts",
        "fake_nccl.py: FakeNccl._wait_connected, _lazy",
        "src/transport.cc; src/init.cc (runtimeConn from NCCL_RUNTIME_CONNECT); src/include/param.h",
        "tests/test_nccl_double.py::test_a_first_send_connects_its_peer_blocking_the_host_on_a_blocking_communicator",
        f"{_GPU}::test_a_first_collective_connects_blocking_the_host_until_the_peer_issues",
    ),
    Rule(
        "nccl-nonblocking-ready",
        "a nonblocking communicator (ncclCommInitRankConfig, 2.14+) is ncclInProgress until every rank joined, "
        "and a call before it reports ncclSuccess is ncclInvalidArgument",
        "fake_nccl.py: FakeNccl.comm_init_rank_config, _check_ready",
        "src/init.cc (ncclCommEnsureReady: 'Attempt to use communicator before the previous operation returned "
        "ncclSuccess')",
        "tests/test_nccl_double.py::test_a_nonblocking_communicator_is_in_progress_until_its_peers_join_and_unusable_until_then",
        f"{_GPU}::test_a_nonblocking_init_whose_peer_never_joins_stays_in_progress_and_refuses_calls",
    ),
    Rule(
        "nccl-nonblocking-launch-thread",
        "from 2.23 a group end with nonblocking communicators returns ncclInProgress and NCCL's own thread "
        "launches it",
        "fake_nccl.py: FakeNccl._launch_on_thread",
        "src/group.cc (ncclGroupEndInternal: groupLaunchNonBlocking on a new thread, ret = ncclInProgress)",
        "tests/test_nccl_p2p_cost.py::test_a_nonblocking_launch_is_waited_for_without_the_device_lock",
        f"{_GPU}::test_a_nonblocking_group_end_returns_in_progress",
    ),
    Rule(
        "nccl-abort-ends-kernels",
        "ncclCommAbort ends the communicator's pending kernels (their streams go on) and frees it; the peers' "
        "parts wait on until they abort too",
        "fake_nccl.py: FakeFabric.abort",
        "nccl.h (ncclCommAbort)",
        "tests/test_nccl_double.py::test_abort_ends_this_ranks_pending_kernel_and_freed_communicators_fail_loudly",
        f"{_GPU}::test_abort_ends_the_communicators_pending_kernel_and_its_stream_goes_on",
    ),
    Rule(
        "nccl-destroy-waits",
        "ncclCommDestroy waits for the communicator's launched operations (for ever if a peer never comes)",
        "fake_nccl.py: FakeNccl.comm_destroy",
        "src/init.cc (commDestroySync)",
        "tests/test_nccl_double.py::test_destroy_waits_for_the_communicators_operations",
        None,
        f"{_TWO_GPUS}; {_HANG}",
    ),
    Rule(
        "nccl-reclaim-waits-for-graphs",
        "NCCL >= 2.26: destroying or aborting the last communicator of a clique polls until every CUDA graph that "
        "captured work on it is destroyed",
        "fake_nccl.py: FakeNccl._reclaim",
        "src/init.cc (commReclaim -> commDestroySync, localPersistentRefs); src/enqueue.cc (reclaimPlan)",
        f"{_CHECKS}::test_the_last_destroy_of_a_clique_with_a_graph_alive_would_wait_for_ever",
        None,
        f"{_TWO_GPUS} (a world-1 collective makes no persistent plan: src/enqueue.cc, ncclLaunchOneRank); {_HANG}",
    ),
    Rule(
        "nccl-memory",
        "a communicator's NCCL buffers take device memory: its collectives' at init (NCCL_RUNTIME_CONNECT=0) or "
        "first use, a peer's point-to-point buffers at its first use; freed by abort and destroy",
        "fake_nccl_memory.py: NcclMemoryModel; fake_nccl.py: FakeNccl._made, _charge_connection",
        "src/init.cc (computeBuffSizes); src/transport/p2p.cc; src/transport/nvls.cc; src/include/device.h",
        "tests/test_nccl_p2p_cost.py::test_a_stage_holds_one_communicator_and_no_pair_of_its_own",
        None,
        "a model of bytes, which depend on the machine's topology (channels, NVLS): benchmarks/gpu_check.py "
        "measures them on a GPU (torch.cuda.mem_get_info), not a pass/fail fact",
    ),
    Rule(
        "torch-nccl-init-rank-broken",
        "torch.cuda.nccl.init_rank raises SystemError on CPython 3.10-3.12 (it parses the id with '#' formats "
        "without PY_SSIZE_T_CLEAN)",
        "fake_nccl.py: broken_torch_init_rank",
        "torch/csrc/cuda/python_nccl.cpp (THCPModule_nccl_init_rank); pytorch#38019",
        "tests/test_nccl_double.py::test_threadpar_never_calls_torch_cuda_nccl_init_rank",
        f"{_GPU}::test_torchs_nccl_init_rank_raises_system_error_on_this_python",
    ),
    # -- CUDA streams, events, copies (fake_cuda_nccl.py, sim_gpu*.py) ------------------------------------------------
    Rule(
        "cuda-wait-latest-record",
        "a stream's wait on an event waits for the event's most recent record only (a later record is not waited "
        "for)",
        "fake_cuda_nccl.py: FakeStream.wait_event",
        "CUDA runtime API (cudaStreamWaitEvent); c10/cuda/CUDAEvent.h (CUDAEvent::block)",
        f"{_CHECKS}::test_a_wait_is_for_the_events_latest_record_only",
        f"{_GPU}::test_a_wait_is_for_the_events_latest_record_only",
    ),
    Rule(
        "cuda-event-one-device",
        "an event belongs to the device of its first recording stream; recording it on another device's stream "
        "fails",
        "fake_cuda_nccl.py: FakeEvent.record",
        "c10/cuda/CUDAEvent.h (CUDAEvent::record: 'Event device ... does not match recording stream's device')",
        "tests/test_fake_event_device.py::test_an_event_recorded_on_another_devices_stream_fails_as_torch_does",
        f"{_GPU}::test_an_event_recorded_on_another_devices_stream_fails",
    ),
    Rule(
        "cuda-stream-pool",
        "torch.cuda.Stream() hands out one of 32 pooled streams per device and priority, round-robin (the 33rd "
        "is the 1st again); wrappers of one stream are equal and hash alike",
        "fake_cuda_nccl.py: FakeCuda.pool_stream; sim_gpu_streams.py: Stream.__eq__, __hash__",
        "c10/cuda/CUDAStream.cpp (getStreamFromPool, kStreamsPerPool); torch/cuda/streams.py (Stream.__eq__)",
        f"{_CHECKS}::test_pool_streams_come_round_robin_from_32_per_priority",
        f"{_GPU}::test_pool_streams_come_round_robin_from_32_per_priority",
    ),
    Rule(
        "cuda-copy-synchronizes",
        "a copy between host and device (.cpu(), .to, .item(), .tolist()) waits for the current stream, unless "
        "non_blocking=True with pinned host memory, which is an asynchronous copy on the stream",
        "sim_gpu.py: _copy_memory, _local_scalar_dense; fake_cuda_nccl.py: FakeCuda.copy",
        "aten/src/ATen/native/cuda/Copy.cu (copy_kernel_cuda, memcpy_and_sync); "
        "aten/src/ATen/native/cuda/CUDAScalar.cu (_local_scalar_dense_cuda)",
        "tests/test_fake_graph.py::test_copies_between_host_and_device_synchronize_and_are_refused_in_a_capture",
        f"{_GPU}::test_a_copy_to_the_host_waits_for_the_stream_unless_pinned_and_non_blocking",
    ),
    Rule(
        "cuda-device-synchronize",
        "torch.cuda.synchronize(device) waits for that device's streams only",
        "fake_cuda_nccl.py: FakeCuda.synchronize",
        "CUDA runtime API (cudaDeviceSynchronize on the current device)",
        "tests/test_sim_gpu.py::test_a_device_synchronize_waits_for_that_gpus_streams_only",
        f"{_GPU}::test_a_device_synchronize_waits_for_that_gpus_streams_only",
    ),
    # -- the device's tensors (sim_gpu.py, sim_gpu_autocast.py, sim_gpu_engine.py) -----------------------------------
    Rule(
        "device-same-device",
        "a device op refuses a host tensor that is not a 0-dim scalar ('Expected all tensors to be on the same "
        "device'); indexing ops take host indices",
        "sim_gpu.py: _Devices, _mismatch, _CROSS_DEVICE",
        "aten/src/ATen/TensorIterator.cpp (compute_types); torch/_subclasses/fake_tensor.py "
        "(_find_common_device); aten/src/ATen/native/TensorAdvancedIndexing.cpp",
        "tests/test_sim_gpu.py::test_mixing_host_and_device_tensors_is_refused_where_torch_refuses_it",
        f"{_GPU}::test_mixing_host_and_device_tensors_is_refused_where_the_double_refuses_it",
    ),
    Rule(
        "device-numpy",
        "Tensor.numpy() of a device tensor is a TypeError naming .cpu()",
        "sim_gpu.py: DeviceTensor.numpy",
        "torch/csrc/utils/tensor_numpy.cpp (tensor_to_numpy)",
        "tests/test_sim_gpu.py::test_a_device_tensor_is_read_on_the_host_only_through_a_copy",
        f"{_GPU}::test_numpy_of_a_device_tensor_is_refused_naming_cpu",
    ),
    Rule(
        "device-generators",
        "random ops on a device draw from that device's default generator (torch.cuda.manual_seed), not the "
        "host's",
        "sim_gpu.py: default_generator, _use_device_generator, _native_dropout",
        "torch/cuda/random.py (manual_seed, default_generators)",
        "tests/test_sim_gpu.py::test_random_ops_draw_from_the_devices_own_generator",
        f"{_GPU}::test_random_ops_draw_from_the_devices_own_generator",
    ),
    Rule(
        "device-pinned-memory",
        "pin_memory() gives pinned host memory, which is_pinned() reports; ordinary host memory is not pinned",
        "sim_gpu.py: _pin, is_pinned, _pinned_memory_methods",
        "aten/src/ATen/native/Memory.cpp (_pin_memory, is_pinned)",
        "tests/test_sim_gpu.py::test_pinned_host_memory",
        f"{_GPU}::test_pinned_host_memory",
    ),
    Rule(
        "device-current-per-thread",
        "the current device is per thread, 0 until set_device; a factory given the device type without an index "
        "uses it",
        "sim_gpu.py: current_device, set_device, _normalize",
        "c10/cuda/CUDAFunctions.cpp (cudaSetDevice is per host thread)",
        "tests/test_sim_gpu.py::test_factories_without_an_index_use_the_threads_current_device",
        f"{_GPU}::test_the_current_device_is_per_thread",
    ),
    Rule(
        "device-ordinal",
        "set_device of an index past the device count fails (invalid device ordinal)",
        "sim_gpu.py: set_device",
        "c10/cuda/CUDAFunctions.cpp (set_device: cudaSetDevice -> cudaErrorInvalidDevice)",
        f"{_CHECKS}::test_an_invalid_device_ordinal_is_refused",
        f"{_GPU}::test_an_invalid_device_ordinal_is_refused",
    ),
    Rule(
        "device-autocast",
        "torch.autocast on the device casts as CUDA's lists say (lower precision, fp32, set-opt-dtype, "
        "append-dtype, promote) and refuses binary_cross_entropy",
        "sim_gpu_autocast.py: register",
        "aten/src/ATen/autocast_mode.h, autocast_mode.cpp",
        "tests/test_sim_gpu.py::test_autocast_on_the_device_casts_as_cuda_autocast_does",
        f"{_GPU}::test_autocast_casts_as_the_double_does",
    ),
    Rule(
        "device-backward-error",
        "an exception a Python callback raises inside a device backward (a hook) reaches backward's caller",
        "sim_gpu_engine.py: carrying, dispatch_boundary",
        "torch/csrc/autograd/engine.cpp; torch/csrc/autograd/python_engine.cpp (python_error rethrown)",
        "tests/test_sim_gpu.py::test_an_error_raised_inside_a_backward_reaches_its_caller",
        f"{_GPU}::test_an_error_raised_in_a_backward_hook_reaches_the_caller",
    ),
    Rule(
        "device-deepcopy",
        "deepcopy of a device tensor copies its memory on the device; of a non-leaf, it is refused",
        "sim_gpu.py: DeviceTensor.__deepcopy__",
        "torch/_tensor.py (Tensor.__deepcopy__)",
        "tests/test_sim_gpu.py::test_deepcopy_copies_the_memory_on_the_device",
        f"{_GPU}::test_deepcopy_of_a_device_tensor_stays_on_the_device_and_refuses_non_leaves",
    ),
    Rule(
        "autograd-device-thread",
        "a device backward runs on autograd's device thread, unless the calling thread turned multithreading off",
        "fake_autograd_thread.py: device_threads",
        "torch/csrc/autograd/engine.cpp (start_device_threads, ready_queue)",
        "tests/test_fake_modes.py::test_backward_runs_on_a_device_thread_without_the_rank_context",
        "tests/cuda/test_cuda_graphs_gpu.py::test_backward_runs_on_the_calling_thread_with_multithreading_off_on_a_gpu",
    ),
    Rule(
        "device-race",
        "a host op on a buffer of a pending NCCL operation or asynchronous copy, not ordered after it, is a race",
        "fake_device.py: _Touches._touch_named (reports a race)",
        "CUDA C Programming Guide 'Streams' (only stream order and events order work)",
        "tests/test_fake_modes.py::test_a_buffer_touched_before_waiting_on_the_work_is_a_race",
        None,
        "a data race: what a GPU reads depends on timing, so no run can assert it",
    ),
    # -- CUDA graphs (fake_graph.py) -----------------------------------------------------------------------------
    Rule(
        "graph-non-default-stream",
        "a CUDA graph is captured on a non-default stream",
        "fake_graph.py: capture",
        "aten/src/ATen/cuda/CUDAGraph.cpp (capture_begin)",
        "tests/test_fake_graph.py::test_a_capture_must_be_on_a_side_stream_and_alone_in_its_process",
        f"{_GPU}::test_a_capture_on_the_default_stream_is_refused",
    ),
    Rule(
        "graph-capture-once",
        "a CUDAGraph is captured once (make a new one to capture again)",
        "fake_graph.py: capture",
        "aten/src/ATen/cuda/CUDAGraph.cpp (capture_begin: 'already owns a captured graph')",
        f"{_CHECKS}::test_a_graph_is_captured_once",
        f"{_GPU}::test_a_graph_is_captured_once",
    ),
    Rule(
        "graph-replay-needs-capture",
        "replaying a graph without a successful capture (or after reset) fails",
        "fake_graph.py: FakeGraph.replay",
        "aten/src/ATen/cuda/CUDAGraph.cpp (replay: 'without a preceding successful capture')",
        f"{_CHECKS}::test_a_graph_replays_only_after_a_successful_capture",
        f"{_GPU}::test_a_graph_replays_only_after_a_successful_capture",
    ),
    Rule(
        "graph-one-capture-per-process",
        "only one capture may be underway at a time in a process",
        "fake_graph.py: capture",
        "torch docs notes/cuda.rst 'Constraints'; c10/cuda/CUDACachingAllocator.cpp (captures_underway)",
        "tests/test_fake_graph.py::test_a_capture_must_be_on_a_side_stream_and_alone_in_its_process",
        None,
        "unverified for torch 2.13: its caching allocator keeps a list of captures underway, each with a stream "
        "filter (CUDAGraph.cpp, create_allocate_filter), so concurrent captures may now be allowed; to be checked "
        "from c10/cuda/CUDACachingAllocator.cpp before a GPU test asserts either way",
    ),
    Rule(
        "graph-records-not-runs",
        "a capture records work without running it (a tensor it writes keeps its value until a replay); each "
        "replay runs the work again",
        "fake_graph.py: FakeGraph.restore, replay; CaptureRecorder",
        "CUDA C Programming Guide 'CUDA Graphs', 'Stream Capture'",
        "tests/test_fake_graph.py::test_capture_runs_nothing_for_real_and_each_replay_runs_the_step",
        f"{_GPU}::test_a_capture_records_without_running_and_each_replay_runs",
    ),
    Rule(
        "graph-generators-advance",
        "random ops in a graph draw new numbers at every replay (graph-safe generators)",
        "fake_graph.py: FakeGraph.remember_generator, restore",
        "aten/src/ATen/cuda/CUDAGeneratorImpl.cpp (capture_prologue, replay_prologue)",
        "tests/test_cuda_graphs.py::test_dropout_draws_anew_at_every_replay_as_eager_steps_do",
        f"{_GPU}::test_random_ops_draw_anew_at_every_replay",
    ),
    Rule(
        "graph-outside-stream-runs-once",
        "work on a stream that never joined the capture runs once, at capture, and is not replayed",
        "fake_graph.py: CaptureRecorder (a stream outside the capture)",
        "CUDA C Programming Guide 'Stream Capture' (only the capturing streams' work is captured)",
        "tests/test_fake_graph.py::test_work_on_a_stream_outside_the_capture_runs_once_and_is_not_replayed",
        f"{_GPU}::test_work_on_a_stream_outside_the_capture_runs_once",
    ),
    Rule(
        "graph-host-value-frozen",
        "a host tensor a device op reads in a capture is read once, at capture: every replay uses that value (the "
        "double refuses it, naming the fix)",
        "fake_graph.py: CaptureRecorder (a host tensor argument)",
        "CUDA kernel arguments are copied at launch; aten/src/ATen/native/cuda/FusedAdamWKernel.cu (lr.item())",
        "tests/test_fake_graph.py::test_a_host_value_read_by_a_device_op_is_refused_at_capture_naming_the_fix",
        f"{_GPU}::test_a_host_scalar_read_in_a_capture_is_frozen_into_the_graph",
    ),
    Rule(
        "graph-host-sync-refused",
        "a host synchronization on the capturing thread (.item(), a branch on a value, nonzero, a synchronous "
        "copy, a stream/event/device synchronize) breaks the capture (cudaErrorStreamCaptureUnsupported, 900)",
        "fake_graph.py: CaptureRecorder (_HOST_SYNCS); fake_cuda_nccl.py: FakeCuda.refuse_during_capture, copy",
        "CUDA runtime API (cudaErrorStreamCaptureUnsupported); aten/src/ATen/native/cuda/Copy.cu (memcpy_and_sync)",
        "tests/test_fake_graph.py::test_the_host_cannot_wait_for_the_device_during_a_capture",
        "tests/cuda/test_cuda_graphs_gpu.py::test_a_host_read_is_refused_at_capture_on_a_gpu",
    ),
    Rule(
        "graph-captured-event",
        "an event last recorded in a capture cannot be queried, synchronized or waited on from outside it "
        "(cudaErrorCapturedEvent, 907)",
        "fake_cuda_nccl.py: FakeEvent._refuse_if_captured, FakeStream.wait_event",
        "CUDA runtime API (cudaErrorCapturedEvent)",
        "tests/test_fake_graph.py::test_captured_events_stay_inside_the_graph_and_outside_events_stay_out",
        f"{_GPU}::test_an_event_recorded_in_a_capture_stays_inside_it",
    ),
    Rule(
        "graph-capture-isolation",
        "a capturing stream cannot wait on an event recorded outside the capture (cudaErrorStreamCaptureIsolation, "
        "905)",
        "fake_cuda_nccl.py: FakeStream.wait_event",
        "CUDA C Programming Guide 'Cross-stream Dependencies and Events'; cudaErrorStreamCaptureIsolation",
        "tests/test_fake_graph.py::test_captured_events_stay_inside_the_graph_and_outside_events_stay_out",
        f"{_GPU}::test_a_capturing_stream_cannot_wait_on_an_event_recorded_outside",
    ),
    Rule(
        "graph-fork-joined",
        "a stream that joined a capture must be joined back into the origin stream before it ends "
        "(cudaErrorStreamCaptureUnjoined, 904)",
        "fake_graph.py: FakeGraph.unjoined",
        "CUDA runtime API (cudaStreamEndCapture: cudaErrorStreamCaptureUnjoined)",
        "tests/test_fake_graph.py::test_a_fork_must_be_joined_back_before_the_capture_ends",
        f"{_GPU}::test_a_fork_not_joined_back_fails_the_end_of_the_capture",
    ),
    Rule(
        "graph-failed-end-leaves-allocator-capturing",
        "when the end of a capture fails, torch's caching allocator keeps the capture underway (capture_end "
        "throws before endAllocateToPool)",
        "fake_graph.py: capture (allocator_stuck)",
        "aten/src/ATen/cuda/CUDAGraph.cpp (capture_end)",
        "tests/test_cuda_graphs.py::test_a_refused_capture_ends_cleanly_and_the_process_captures_again",
        None,
        "what a later capture then does depends on the allocator's captures_underway handling (see "
        "graph-one-capture-per-process), unverified for torch 2.13",
    ),
    Rule(
        "graph-optimizer-capturable",
        "an optimizer with a capturable option refuses step() inside a capture unless capturable=True",
        "fake_graph.py: _optimizer_health_check",
        "torch/optim/optimizer.py (Optimizer._accelerator_graph_capture_health_check)",
        "tests/test_cuda_graphs.py::test_a_non_capturable_optimizer_is_refused_at_capture",
        f"{_GPU}::test_a_non_capturable_optimizer_refuses_a_step_in_a_capture",
    ),
    Rule(
        "graph-nccl-all-or-none",
        "the communicators of one NCCL group are all captured by one graph or none",
        "fake_nccl.py: FakeNccl._launch",
        "src/group.cc (groupLaunch: 'Either none or all communicators in a ncclGroup() can be CUDA graph "
        "captured'); src/enqueue.cc (ncclPlannerSetCapturingGraph)",
        "tests/test_fake_graph.py::test_nccl_communicators_of_one_group_are_all_captured_or_none",
        None,
        f"{_TWO_GPUS} (a world-1 collective bypasses the planner: ncclLaunchOneRank), and the failing group leaves "
        "its communicators 'permanently trashed' (src/group.cc's comment)",
    ),
    Rule(
        "graph-replay-in-capture",
        "the double: a replay on the capturing thread during a capture is refused (900)",
        "fake_graph.py: FakeGraph.replay",
        "CUDA runtime API (cudaErrorStreamCaptureUnsupported)",
        f"{_CHECKS}::test_a_replay_inside_a_capture_is_refused",
        None,
        "unverified: CUDA 12 can launch a graph into a capturing stream (it becomes a child graph node), so the "
        "double's refusal may be stricter than a GPU; to be checked against CUDA's docs first",
    ),
)


def covered(rules: tuple[Rule, ...] = RULES) -> list[Rule]:
    return [r for r in rules if r.gpu_test is not None]


def count_line(rules: tuple[Rule, ...] = RULES) -> str:
    return f"double rules with a GPU-tier test of the same fact: {len(covered(rules))}/{len(rules)}"


def table(rules: tuple[Rule, ...] = RULES) -> str:
    width = max(len(r.id) for r in rules)
    lines = [f"{'id':<{width}}  gpu  fact"]
    for r in rules:
        lines.append(f"{r.id:<{width}}  {'yes' if r.gpu_test else 'no ':<3}  {r.fact}")
        if r.gpu_test is None:
            lines.append(f"{'':<{width}}       (no GPU test: {r.why_no_gpu_test})")
    lines.append(count_line(rules))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")

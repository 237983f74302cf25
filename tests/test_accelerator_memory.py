"""The memory API a CUDA program reaches on ``neuron``: ``torch.accelerator``'s memory functions (through the
allocator's ``c10::DeviceAllocator`` interface), the host (pinned) allocator torch looks up for the device, and
the ``torch.cuda.memory`` functions beyond statistics (memory fraction, raw allocations, deprecated names,
history in its older form, snapshot arguments), on the real allocator. Paths that crashed run in a child.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
from _neuron_child import run_child

import torchneuron_lab  # noqa: F401

N = torch.neuron


def test_empty_host_cache_after_the_device_is_used_does_not_crash() -> None:
    # at::accelerator::emptyHostCache() called through a null host allocator: SIGSEGV once a tensor existed
    facts = run_child("""
        import json, torch, torchneuron_lab
        torch.accelerator.empty_host_cache()                 # before any use
        x = torch.ones(4, device="neuron")
        p = torch.ones(256).pin_memory()
        torch.accelerator.empty_host_cache()
        print(json.dumps({"x": x.sum().item(), "pinned": p.is_pinned()}))
    """)
    assert facts == {"x": 4.0, "pinned": True}


def test_accelerator_memory_functions_read_the_neuron_allocator() -> None:
    # every one raised "INTERNAL ASSERT FAILED ... Allocator for neuron is not a DeviceAllocator"
    acc = torch.accelerator
    assert acc.current_accelerator() == torch.device("neuron")
    torch.neuron.synchronize()
    N.empty_cache()
    a0 = acc.memory_allocated()
    x = torch.empty(1000, device="neuron")  # 4000 bytes: one 4096-byte block
    assert acc.memory_allocated() - a0 == 4096 == N.memory_allocated() - a0
    assert acc.max_memory_allocated() == N.max_memory_allocated()
    assert acc.memory_reserved() == N.memory_reserved() > 0
    assert acc.max_memory_reserved() == N.max_memory_reserved()
    assert acc.memory_stats() == N.memory_stats()  # every key and value, max_split_size (-1) included
    assert acc.memory_stats()["max_split_size"] == -1
    assert acc.get_memory_info() == N.mem_get_info()
    assert acc.memory_stats(1) == N.memory_stats(1)
    del x
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated() == a0
    acc.reset_accumulated_memory_stats()
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == 0
    torch.neuron.synchronize()
    acc.empty_cache()
    assert acc.memory_reserved() == N.memory_reserved()
    with pytest.raises(RuntimeError, match="invalid neuron device index"):
        torch._C._accelerator_getDeviceStats(7)


def test_accelerator_empty_cache_before_any_use_is_a_no_op() -> None:
    facts = run_child("""
        import json, torch, torchneuron_lab
        before = torch._C._accelerator_isAllocatorInitialized()
        torch.accelerator.empty_cache()
        stats = torch.accelerator.memory_stats()
        x = torch.ones(2, device="neuron")
        print(json.dumps({"before": before, "stats": len(stats), "after": torch._C._accelerator_isAllocatorInitialized()}))
    """)
    assert facts == {"before": False, "stats": 0, "after": True}


def test_host_memory_stats_count_pinned_allocations() -> None:
    s0 = N.host_memory_stats()
    p = torch.ones(1000).pin_memory()
    s1 = N.host_memory_stats()
    assert p.is_pinned()
    assert s1["active_bytes.current"] - s0["active_bytes.current"] == 4000
    assert s1["active_requests.current"] - s0["active_requests.current"] == 1
    assert s1["num_host_alloc"] - s0["num_host_alloc"] == 1
    del p
    s2 = N.host_memory_stats()
    assert s2["active_bytes.current"] == s0["active_bytes.current"]
    assert s2["num_host_free"] - s0["num_host_free"] == 1
    # torch.cuda.host_memory_stats' keys
    expected = {f"{k}.{m}" for k in ("active_requests", "active_bytes", "allocations", "allocated_bytes")
                for m in ("current", "peak", "allocated", "freed")}
    expected |= {f"{k}.{m}" for k in ("host_alloc_time", "host_free_time") for m in ("total", "max", "min", "count", "avg")}
    assert set(s2) == expected | {"num_host_alloc", "num_host_free"}
    N.reset_peak_host_memory_stats()
    N.reset_accumulated_host_memory_stats()
    s3 = N.host_memory_stats()
    assert s3["active_bytes.peak"] == s3["active_bytes.current"]
    assert s3["active_bytes.allocated"] == 0 and s3["num_host_alloc"] == 0
    assert N.host_memory_stats_as_nested_dict()["active_bytes"]["current"] == s3["active_bytes.current"]


def test_per_process_memory_fraction_limits_what_the_allocator_reserves() -> None:
    facts = run_child("""
        N = torch.neuron
        total = N.mem_get_info()[1]
        f0 = N.get_per_process_memory_fraction()
        N.set_per_process_memory_fraction(0.001)
        limit = int(0.001 * total)
        small = torch.empty(limit // 8, dtype=torch.uint8, device="neuron")  # fits
        before_big = N.memory_allocated()
        big = outcome(lambda: torch.empty(limit, dtype=torch.uint8, device="neuron").shape)
        after_oom = N.memory_allocated()  # the failed request left nothing allocated
        f1 = N.get_per_process_memory_fraction()
        N.set_per_process_memory_fraction(1.0)
        ok = torch.empty(limit, dtype=torch.uint8, device="neuron").numel()
        emit({"f0": f0, "f1": f1, "big": big, "limit": limit, "ok": ok, "before_big": before_big,
              "allocated_after_oom": after_oom,
              "bad": [outcome(lambda v=v: N.set_per_process_memory_fraction(v)) for v in (1, 1.5, -0.1)]})
    """, outcomes=True)
    assert facts["f0"] == 1.0 and facts["f1"] == 0.001
    assert facts["big"]["error"] == "OutOfMemoryError"
    assert "set_per_process_memory_fraction(0.001000)" in facts["big"]["message"]
    assert facts["ok"] == facts["limit"]
    assert facts["allocated_after_oom"] == facts["before_big"] > 0
    assert facts["bad"] == [
        {"error": "TypeError", "message": "Invalid type for fraction argument, must be `float`"},
        {"error": "ValueError", "message": "Invalid fraction value: 1.5. Allowed range: 0~1"},
        {"error": "ValueError", "message": "Invalid fraction value: -0.1. Allowed range: 0~1"},
    ]


def test_caching_allocator_alloc_and_delete() -> None:
    torch.neuron.synchronize()
    a0 = N.memory_allocated()
    ptr = N.caching_allocator_alloc(1000)
    assert isinstance(ptr, int) and ptr != 0
    assert N.memory_allocated() - a0 == 1024  # rounded to 512 bytes, as CUDA's
    assert any(seg["address"] <= ptr < seg["address"] + seg["total_size"] for seg in N.memory_snapshot())
    N.caching_allocator_delete(ptr)
    assert N.memory_allocated() == a0
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        N.caching_allocator_delete(ptr)
    s = N.Stream()
    ptr = N.caching_allocator_alloc(100, device="neuron:0", stream=s)
    seg = next(seg for seg in N.memory_snapshot() if seg["address"] <= ptr < seg["address"] + seg["total_size"])
    assert seg["stream"] == s.stream_id
    N.caching_allocator_delete(ptr)
    assert N.caching_allocator_alloc(0) == 0
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        N.caching_allocator_alloc(100, stream="s")
    with pytest.raises(ValueError, match="neuron:1"):
        N.caching_allocator_alloc(100, device=0, stream=N.Stream(device=1))
    assert N.get_allocator_backend() == "native"


def test_deprecated_cached_names_warn_and_read_reserved() -> None:
    with pytest.warns(FutureWarning, match="renamed to torch.neuron.memory_reserved"):
        assert N.memory_cached() == N.memory_reserved()
    with pytest.warns(FutureWarning, match="renamed to torch.neuron.max_memory_reserved"):
        assert N.max_memory_cached() == N.max_memory_reserved()
    with pytest.warns(FutureWarning, match="resets /all/ peak"):
        N.reset_max_memory_cached()
    assert N.max_memory_reserved() == N.memory_reserved()


def test_torch_cuda_memory_names_exist_on_torch_neuron() -> None:
    # what stays missing is what the emulator has no counterpart for (pluggable allocators, private pools,
    # a process list of the GPU driver)
    missing = sorted(set(torch.cuda.memory.__all__) - set(dir(N)))
    assert missing == ["CUDAPluggableAllocator", "MemPool", "caching_allocator_disabled", "caching_allocator_enable",
                       "change_current_allocator", "list_gpu_processes", "use_mem_pool"]


def test_record_memory_history_in_its_older_bool_form() -> None:
    try:
        N.memory._record_memory_history(True)  # as torch.cuda: live allocations' stacks only, no trace
        x = torch.ones(100, device="neuron")
        y = torch.ones(200, device="neuron")
        state_only = [len(t) for t in N.memory._snapshot()["device_traces"]]
        N.memory._record_memory_history(True, trace_alloc_max_entries=100, trace_alloc_record_context=True)
        z = torch.ones(300, device="neuron")
        trace = N.memory._snapshot()["device_traces"][0]
    finally:
        N.memory._record_memory_history(False)
    assert state_only[0] <= 1
    alloc = [e for e in trace if e["action"] == "alloc" and e["addr"] == z.data_ptr()]
    assert len(alloc) == 1 and alloc[0]["frames"]
    del x, y


def test_snapshot_takes_torch_cuda_arguments(tmp_path: os.PathLike[str]) -> None:
    x = torch.ones(100, device="neuron")
    snap = N.memory._snapshot(augment_with_fx_traces=True)
    assert any(seg["device"] == 0 for seg in snap["segments"])
    path = os.path.join(tmp_path, "s.pickle")
    N.memory._dump_snapshot(path, augment_with_fx_traces=True)
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"]
    assert N.memory_snapshot(include_traces=False) == N.memory_snapshot()
    del x


def test_a_bad_fork_child_sees_no_initialized_device() -> None:
    facts = run_child("""
        import json, os, torch, torchneuron_lab
        x = torch.ones(1000, device="neuron")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            N = torch.neuron
            out = {"init": N.is_initialized(), "stats": N.memory_stats(), "alloc": N.memory_allocated(),
                   "acc_init": torch._C._accelerator_isAllocatorInitialized()}
            N.empty_cache()
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        data = os.read(r, 100000)
        os.waitpid(pid, 0)
        child = json.loads(data)
        print(json.dumps({"child": child, "parent_init": torch.neuron.is_initialized()}))
    """)
    assert facts == {"child": {"init": False, "stats": {}, "alloc": 0, "acc_init": False}, "parent_init": True}


def test_autocast_bans_binary_cross_entropy_and_runs_norm_in_float32() -> None:
    x = torch.randn(4, 4, device="neuron")
    with torch.autocast("neuron", dtype=torch.float16):
        p = torch.sigmoid(x @ x)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(p, torch.rand(4, 4, device="neuron"))
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.BCELoss()(p, p.detach())
        h = x.half()
        assert torch.ops.aten.norm.Scalar(h, 2).dtype == torch.float32
        assert torch.ops.aten.norm.ScalarOpt_dim(h, 2, [0], False).dtype == torch.float32
        assert torch.ops.aten.norm.Scalar(h, 2).item() == torch.ops.aten.norm.Scalar(h.float(), 2).item()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "target dtype is not supported. Disabling autocast" before
        with torch.autocast("neuron", dtype=torch.float32):
            assert torch.is_autocast_enabled("neuron")
            assert (x @ x).dtype == torch.float32


def test_sparse_embedding_bag_gradient_is_a_sparse_neuron_tensor_equal_to_cpus() -> None:
    grads = []
    for dev in ("cpu", "neuron"):
        torch.manual_seed(0)
        eb = torch.nn.EmbeddingBag(10, 3, sparse=True).to(dev)
        eb(torch.tensor([[1, 2], [2, 7]], device=dev)).pow(2).sum().backward()
        grads.append(eb.weight.grad)
    cpu, neuron = grads
    assert neuron.layout == torch.sparse_coo and neuron.device == torch.device("neuron:0")
    assert neuron._values().device == neuron._indices().device == torch.device("neuron:0")
    assert torch.equal(neuron._indices().cpu(), cpu._indices()) and torch.equal(neuron._values().cpu(), cpu._values())
    assert torch.equal(neuron.to_dense().cpu(), cpu.to_dense())


def test_a_child_forked_while_kernels_are_queued_raises_at_once_instead_of_waiting_for_them() -> None:
    # the child inherited queue positions no worker would ever complete: synchronize, get_rng_state,
    # manual_seed (a DataLoader worker_init_fn) waited the whole sync timeout (600 s) before failing
    facts = run_child("""
        import json, os, time, torch, torchneuron_lab
        N = torch.neuron
        (torch.ones(4, device="neuron") + 1).cpu()
        N._sleep(5000)  # the parent's queue is busy when it forks
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            out = {}
            for name, call in [("synchronize", N.synchronize),
                               ("stream synchronize", lambda: N.current_stream().synchronize()),
                               ("get_rng_state", N.get_rng_state),
                               ("manual_seed", lambda: N.manual_seed(1)),
                               ("manual_seed_all", lambda: N.manual_seed_all(1)),
                               ("generator manual_seed", lambda: torch.Generator("neuron").manual_seed(1))]:
                t0 = time.perf_counter()
                try:
                    call()
                    what = "ok"
                except RuntimeError as e:
                    what = "bad fork" if "Cannot re-initialize neuron in forked subprocess" in str(e) else str(e)
                out[name] = [what, time.perf_counter() - t0 < 1.0]
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        data = os.read(r, 100000)
        os.waitpid(pid, 0)
        print(json.dumps(json.loads(data)))
    """, env={"TORCHNEURON_LAB_SYNC_TIMEOUT": "20"}, timeout=120)
    assert facts == {"synchronize": ["bad fork", True], "stream synchronize": ["bad fork", True],
                     "get_rng_state": ["bad fork", True], "manual_seed": ["ok", True],
                     "manual_seed_all": ["ok", True], "generator manual_seed": ["ok", True]}


def test_caching_allocator_delete_of_the_null_pointer_of_a_zero_byte_alloc_is_a_no_op() -> None:
    # CUDA's caching_allocator_delete returns on a null pointer; alloc(0) returns one, so the pair failed on neuron
    before = torch.neuron.memory_stats()["allocation.all.current"]
    p = torch.neuron.caching_allocator_alloc(0)
    assert p == 0
    torch.neuron.caching_allocator_delete(p)
    assert torch.neuron.memory_stats()["allocation.all.current"] == before
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        torch.neuron.caching_allocator_delete(12345)  # a pointer it never gave out still raises


def test_a_bad_fork_child_gets_the_error_from_every_stream_event_and_rng_call_and_never_blocks() -> None:
    # torch.cuda raises "Cannot re-initialize CUDA in forked subprocess" from synchronize, current_stream, a new
    # stream, an event's record, a stream's query and get_rng_state (all call _lazy_init); on neuron they returned
    # silently, and a child forked while a worker held a stream queue's lock blocked forever in query() or
    # record() (13 children of 20 in a hostile probe). Each fork here happens with tiny kernels in flight.
    facts = run_child("""
        import json, os, time, torch, torchneuron_lab
        N = torch.neuron
        calls = [("synchronize", N.synchronize), ("current_stream", N.current_stream),
                 ("default_stream", N.default_stream), ("new stream", lambda: N.Stream()),
                 ("torch.Stream", lambda: torch.Stream(device="neuron")),
                 ("event record", lambda: N.Event().record()),
                 ("torch.Event record", lambda: torch.Event(device="neuron").record()),
                 ("stream query", lambda: s.query()), ("other stream query", lambda: s2.query()),
                 ("stream synchronize", lambda: s2.synchronize()), ("event query", lambda: ev.query()),
                 ("accelerator synchronize", torch.accelerator.synchronize),
                 ("get_rng_state", N.get_rng_state), ("kernel", lambda: torch.ones(2, device="neuron") + 1)]
        x = torch.ones(64, device="neuron")
        s, s2, ev = N.current_stream(), N.Stream(), N.Event()  # made by the parent, used by the child
        ev.record(s2)
        runs = []
        for attempt in range(8):
            for _ in range(300):
                x.add_(1)  # the workers are busy (and take their queue's lock) when the process forks
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                out = {}
                try:
                    for name, call in calls:
                        t0 = time.perf_counter()
                        try:
                            call()
                            what = "returned"
                        except Exception as e:
                            what = ("bad fork" if "Cannot re-initialize neuron in forked subprocess" in str(e)
                                    else f"{type(e).__name__}: {e}")
                        out[name] = [what, time.perf_counter() - t0 < 2.0]
                    del x  # freeing an inherited tensor stays allowed (and must not block either)
                    out["allocated"] = N.memory_allocated()
                except BaseException as e:
                    out["child failed"] = repr(e)
                finally:
                    os.write(w, json.dumps(out).encode())
                    os._exit(0)
            os.close(w)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                runs.append("child blocked for 30 s")
                continue
            runs.append(json.loads(os.read(r, 100000) or b'"no report"'))
        N.synchronize()
        print(json.dumps({"runs": runs, "parent": x[0].item()}))
    """, timeout=400)
    expected = {name: ["bad fork", True] for name in (
        "synchronize", "current_stream", "default_stream", "new stream", "torch.Stream", "event record",
        "torch.Event record", "stream query", "other stream query", "stream synchronize", "event query",
        "accelerator synchronize", "get_rng_state", "kernel")}
    expected["allocated"] = 0
    for run in facts["runs"]:
        assert run == expected, {k: v for k, v in (run.items() if isinstance(run, dict) else [("run", run)]) if expected.get(k) != v}
    assert facts["parent"] == 1 + 8 * 300  # the parent's device is unaffected


def test_a_lowered_memory_fraction_still_serves_requests_from_cached_blocks() -> None:
    # As CUDA's allocator: the fraction bounds what is *reserved* (checked where a new segment is needed), so a
    # cached free block serves a request even above the limit; an OOM names the segment it needed, and counts one
    # retry and one sync of all streams (the cache released first), as empty_cache() counts one sync
    facts = run_child("""
        N = torch.neuron
        MiB = 2**20
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="neuron")  # a 30 MiB segment
        y = torch.empty(1, device="neuron")  # a 2 MiB segment of the small pool
        del x, y  # both cached
        N.set_per_process_memory_fraction(25.6 * MiB / N.mem_get_info()[1])
        s0 = N.memory_stats()
        a = torch.empty(27 * MiB, dtype=torch.uint8, device="neuron")  # above the limit: the cached block
        served = (N.memory_reserved(), N.memory_allocated())
        del a
        N.set_per_process_memory_fraction(0.0)
        b = torch.empty(1, device="neuron")  # 4 bytes: a block of the cached small segment
        small_ok = N.memory_allocated()
        del b
        s1 = N.memory_stats()
        N.empty_cache()
        N.empty_cache()
        s2 = N.memory_stats()
        N.set_per_process_memory_fraction(25.6 * MiB / N.mem_get_info()[1])
        oom = outcome(lambda: torch.empty(27 * MiB, dtype=torch.uint8, device="neuron"))
        s3 = N.memory_stats()
        emit({"served": served, "small_ok": small_ok, "oom": oom,
              "retries": [s["num_alloc_retries"] for s in (s0, s1, s2, s3)],
              "syncs": [s["num_sync_all_streams"] for s in (s0, s1, s2, s3)],
              "ooms": [s["num_ooms"] for s in (s0, s1, s2, s3)]})
    """, env={"TORCHNEURON_LAB_HBM_BYTES": str(256 * 2**20)}, outcomes=True)
    MiB = 2**20
    assert facts["served"] == [32 * MiB, 27 * MiB]  # the 27 MiB block split from the cached 30 MiB segment
    assert facts["small_ok"] == 512
    assert facts["oom"]["error"] == "OutOfMemoryError"
    assert "Tried to allocate 27.00 MiB (needs a new 28.00 MiB segment)" in facts["oom"]["message"]
    assert facts["retries"] == [0, 0, 0, 1]
    assert facts["syncs"] == [0, 0, 2, 3]
    assert facts["ooms"] == [0, 0, 0, 1]

"""torch.profiler and the legacy autograd profiler on the asynchronous device.

A queued kernel runs on a device worker after its op returned on the host: the profilers must still tie it
to that op (Kineto's correlation id, carried by the launch), time ops on the device (the legacy profiler's
device events are markers on the stream), and see the device's allocations (profile_memory=True).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import torchneuron_lab  # noqa: F401  (registers the device)
from tests._neuron_child import run_child

N = torch.neuron
ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def test_queued_kernels_are_correlated_with_the_op_that_launched_them() -> None:
    # the worker read its own (empty) correlation stack: every queued kernel had correlation 0, so no op had
    # device time in key_averages() (undercounted) and Perfetto drew no launch arrows
    x = torch.ones(256, 256, device="neuron")
    (x @ x).cpu()  # a signature's first launch runs on the host
    with profile(activities=ACTIVITIES) as prof:
        N._sleep(30)  # everything below is queued
        for _ in range(4):
            x @ x
        N.synchronize()
    mms = [e for e in prof.events() if e.name == "aten::mm" and e.device_type == torch.autograd.DeviceType.CPU]
    assert len(mms) == 4
    assert [len(e.kernels) for e in mms] == [1, 1, 1, 1]
    assert all(e.device_time_total > 0 for e in mms)


def test_profile_memory_sees_device_allocations() -> None:
    with profile(activities=ACTIVITIES, profile_memory=True) as prof:
        z = torch.empty(1 << 20, device="neuron")
        del z
    rows = {e.key: e for e in prof.key_averages()}
    assert rows["aten::empty"].device_memory_usage == 4 << 20
    assert rows["aten::empty"].cpu_memory_usage == 0
    freed = [e.device_memory_usage for e in prof.events() if e.name == "[memory]"]
    assert freed == [-(4 << 20)]  # `del z`, outside any op


def test_legacy_profiler_times_ops_on_the_device() -> None:
    # a device event was a host timestamp: a queued 1024^2 matmul had a few microseconds of "device time".
    # (In a fresh process: after a torch.profiler session in the same process, torch also hands the legacy
    # profiler the Kineto activities, and each op lists its kernel twice.)
    facts = run_child("""
        import json, torch, torchneuron_lab
        N = torch.neuron
        big = torch.ones(1024, 1024, device="neuron")
        (big @ big).cpu()
        start, end = N.Event(enable_timing=True), N.Event(enable_timing=True)
        with torch.autograd.profiler.profile(use_device="neuron") as prof:
            (big @ big).cpu()  # the session's first op carries the profiler's own start-up on the host (13 ms
            #                    once, on another machine): not part of what is measured
            N._sleep(200)  # the stream is held: the markers and the matmuls run back to back on any machine
            start.record()
            for _ in range(3):
                big @ big
            end.record()
            N.synchronize()
        mms = [e for e in prof.function_events
               if e.name == "aten::mm" and e.device_type == torch.autograd.DeviceType.CPU][1:]
        print(json.dumps({"device_us": [e.device_time_total for e in mms], "cpu_us": [e.cpu_time_total for e in mms],
                          "event_us": start.elapsed_time(end) * 1000}))
    """)
    assert len(facts["device_us"]) == 3, facts
    assert 0.9 * facts["event_us"] <= sum(facts["device_us"]) <= facts["event_us"] * 1.01  # between the events
    assert sum(facts["device_us"]) > 5 * sum(facts["cpu_us"]), facts  # launched, not run, on the host


def test_kernels_queued_at_stop_belong_to_their_session() -> None:
    # profile.__exit__ synchronises the current device only: kernels still queued on neuron:1 were lost (17 of 20
    # recorded), or recorded by the next session with the old correlation ids
    b = torch.randn(384, 384, device="neuron:1")
    a = torch.randn(8, device="neuron:0")
    torch.neuron.synchronize(1)
    with profile(activities=ACTIVITIES) as first:
        for _ in range(20):
            b @ b
    with profile(activities=ACTIVITIES) as second:
        a.relu()
    mms = [e for e in first.events() if e.name == "aten::mm" and e.device_type == torch.autograd.DeviceType.CPU]
    assert len(mms) == 20 and [len(e.kernels) for e in mms] == [1] * 20
    assert {k.device for e in mms for k in e.kernels} == {1}
    assert not [e for e in second.events() if e.name == "aten::mm"]


def test_chrome_trace_names_transfers_and_gives_each_stream_its_track(tmp_path: Path) -> None:
    # Kineto's writer named every DMA "unknown" (its "device→host" is not ASCII), and the kernels of two streams
    # shared one track, overlapping
    import json

    a = torch.randn(256, 256, device="neuron")
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    torch.neuron.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        a.cpu()
        for _ in range(3):
            with torch.neuron.stream(s1):
                a @ a
            with torch.neuron.stream(s2):
                a @ a
        torch.neuron.synchronize()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    copies = [e["name"] for e in events if e.get("cat") == "gpu_memcpy"]
    assert copies == ["dma: device->host"]
    mms = [e for e in events if e.get("cat") == "kernel" and e["name"] == "aten::mm"]
    assert sorted(e["args"]["stream"] for e in mms) == sorted([s1.stream_id] * 3 + [s2.stream_id] * 3)
    tracks = {e["args"]["stream"]: e["tid"] for e in mms}
    assert len(set(tracks.values())) == 2  # one track per stream
    for tid in set(tracks.values()):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in mms if e["tid"] == tid)
        assert all(b0 >= a1 - 1 for (_, a1), (b0, _) in itertools.pairwise(spans))  # no overlap in a track


def test_a_first_calls_host_check_adds_no_ops_to_the_profile() -> None:
    # the first launch of a signature runs the CPU kernel on the host to check its plan: its inner ATen calls
    # (le, where, empty_permuted... under relu) were recorded as the program's ops
    x = torch.randn(3, 5, 7, 11, device="neuron")  # a shape no other test uses
    with profile(activities=[ProfilerActivity.CPU]) as first:
        x.relu()
    with profile(activities=[ProfilerActivity.CPU]) as second:
        x.relu()
    assert [e.name for e in first.events()] == [e.name for e in second.events()]
    assert "aten::le" not in [e.name for e in first.events()]

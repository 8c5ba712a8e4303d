"""The timeline converter on a synthetic Chrome trace."""

from bench.timeline import timeline


def kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kernels_become_stream_blocks():
    trace = {"traceEvents": [
        kernel("ampere_bf16_gemm", 100, 10),
        kernel("ncclDevKernel_AllGather_RING_LL", 105, 20),
        kernel("elementwise_kernel", 112, 5),       # merged with the gemm (gap 2 µs)
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 130, 8),
        kernel("ampere_bf16_gemm", 400, 10),        # a new block (gap > 50 µs)
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1},
    ]}
    events = timeline(trace)
    assert [(e["stream"], e["name"]) for e in events] == [
        ("compute", "compute"), ("gather", "all-gather"),
        ("reduce", "reduce-scatter"), ("compute", "compute"),
    ]
    assert events[0]["start"] == 0.0 and events[0]["end"] == 17e-6
    assert events[-1]["start"] == 300e-6

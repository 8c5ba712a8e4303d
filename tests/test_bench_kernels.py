"""The kernel summary sums a trace's GPU time by kind and stream, and its busy
time is the union over streams."""

from bench import kernels


def _kernel(name, ts, dur, stream, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_kinds_streams_busy_and_wall():
    trace = {"traceEvents": [
        _kernel("sm90_xmma_gemm_bf16", 0, 100, 7),
        _kernel("flash_fwd_kernel", 100, 50, 7),
        _kernel("ncclDevKernel_AllGather_RING", 20, 60, 21),
        _kernel("multi_tensor_apply_kernel<FusedAdam>", 200, 30, 30),
        _kernel("Memcpy DtoD", 240, 10, 7, cat="gpu_memcpy"),
        _kernel("vectorized_elementwise_kernel", 250, 5, 7),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},
    ]}
    s = kernels.summary(trace)
    assert s["by_kind_ms"] == {"matmul": 0.1, "collective": 0.06, "attention": 0.05,
                               "optimizer": 0.03, "copy": 0.01, "other": 0.005}
    assert s["by_stream_ms"]["7"] == 0.165
    # [0,150) ∪ [200,230) ∪ [240,255): the all-gather hides under the compute
    assert s["busy_ms"] == 0.195
    assert s["wall_ms"] == 0.255
    assert list(s["top_ms"])[0] == "sm90_xmma_gemm_bf16"


def test_union_of_nested_and_touching_intervals():
    assert kernels.union_us([(0, 10), (2, 5), (10, 12), (20, 21)]) == 13

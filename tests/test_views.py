"""Zero-copy views (pyexpcache.views, pyexpcache._dlpack): DLPack and the array interfaces hand
consumers the view's own address, the capsule keeps the view alive exactly as long as a consumer
needs it, and on CUDA a consumer's stream is made to wait for the view's.

The host tests use a numpy array's memory as the "device" memory (cuda=False). The stream
logic of CUDA views runs everywhere against a fake cuda-python runtime (no memory is touched:
a capsule that nobody consumes is never read). The tests at the end need a GPU, cuda-python and
PyTorch or CuPy with CUDA."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from pyexpcache import _cuda, _dlpack, views
from pyexpcache.views import ExpertView, TensorView


@pytest.fixture
def backing():
    """64 bytes of host memory standing in for a cached part: 0, 1, ..., 63."""
    return np.arange(64, dtype=np.uint8)


def host_view(array: np.ndarray, **kwargs) -> TensorView:
    return TensorView(array.ctypes.data, array.nbytes, cuda=False, **kwargs)


def released(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


# --- host backend: numpy ------------------------------------------------------------------------


@pytest.mark.parametrize("consume", [np.from_dlpack, np.asarray], ids=["from_dlpack", "asarray"])
def test_numpy_sees_the_same_bytes_without_a_copy(backing, consume):
    view = host_view(backing)
    got = consume(view)
    assert got.dtype == np.uint8 and got.shape == (64,)
    assert got.ctypes.data == backing.ctypes.data
    assert (got == backing).all()
    backing[5] = 200  # a write to the memory shows through the consumer's array
    assert got[5] == 200


def test_dtype_and_shape_are_the_consumers(backing):
    view = host_view(backing, dtype="float16", shape=(4, 8))
    assert view.dtype == np.float16 and view.shape == (4, 8) and view.nbytes == 64
    for got in (np.from_dlpack(view), np.asarray(view)):
        assert got.dtype == np.float16 and got.shape == (4, 8)
        assert got.ctypes.data == backing.ctypes.data
        assert got.tobytes() == backing.tobytes()


def test_default_shape_is_all_the_bytes(backing):
    assert host_view(backing).shape == (64,)
    assert host_view(backing, dtype=np.float32).shape == (16,)
    assert host_view(backing, dtype=np.dtype("int64")).shape == (8,)
    assert host_view(backing, dtype="uint8", shape=64).shape == (64,)


def test_a_shape_that_does_not_cover_the_bytes_is_refused(backing):
    with pytest.raises(ValueError, match=r"48 bytes.*64 bytes"):
        host_view(backing, dtype="float16", shape=(3, 8))
    with pytest.raises(ValueError, match=r"63 bytes.*2 bytes"):
        TensorView(backing.ctypes.data, 63, cuda=False, dtype="float16")
    with pytest.raises(ValueError):
        host_view(backing, shape=(-1, 64))


@pytest.mark.parametrize("bad", [np.complex64, np.bool_, object, ">f4" if np.little_endian else "<f4", "nope"])
def test_dtypes_dlpack_cannot_carry_are_refused(backing, bad):
    with pytest.raises(TypeError):
        host_view(backing, dtype=bad)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"ptr": -1}, ValueError),
        ({"ptr": True}, TypeError),
        ({"ptr": 1.0}, TypeError),
        ({"ptr": 0}, ValueError),
        ({"nbytes": -64}, ValueError),
        ({"nbytes": False}, TypeError),
        ({"nbytes": 1 << 64}, ValueError),
        ({"device_id": -1}, ValueError),
        ({"stream": -2}, ValueError),
        ({"stream": True}, TypeError),
    ],
)
def test_arguments_are_checked(backing, kwargs, error):
    args = {"ptr": backing.ctypes.data, "nbytes": 64, **kwargs}
    with pytest.raises(error):
        TensorView(args.pop("ptr"), args.pop("nbytes"), cuda=False, **args)


def test_an_empty_view_exports():
    view = TensorView(0, 0, cuda=False)
    assert view.__array_interface__["data"] == (0, False)
    assert np.from_dlpack(view).shape == (0,) and np.asarray(view).shape == (0,)


def test_bfloat16_has_no_array_interface(backing):
    view = host_view(backing, dtype="bfloat16", shape=(4, 8))
    assert view.dtype is _dlpack.BFLOAT16 and view.shape == (4, 8)
    with pytest.raises(TypeError, match="bfloat16"):
        _ = view.__array_interface__
    with pytest.raises(TypeError, match="bfloat16"):
        np.asarray(view)
    assert 'capsule object "dltensor"' in repr(view.__dlpack__())  # DLPack carries bfloat16


def test_interfaces_and_device(backing):
    view = host_view(backing, dtype="<f2", shape=(2, 16))
    assert view.__dlpack_device__() == (1, 0)
    assert not hasattr(view, "__cuda_array_interface__")
    assert view.__array_interface__ == {
        "shape": (2, 16),
        "typestr": "<f2",
        "data": (backing.ctypes.data, False),
        "version": 3,
        "strides": None,
    }
    assert "device=host" in repr(view) and "float16" in repr(view) and "(2, 16)" in repr(view)


def test_copy_and_another_device_are_refused(backing):
    view = host_view(backing)
    with pytest.raises(BufferError, match="copy=True"):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device="cpu")
    with pytest.raises(BufferError):
        np.from_dlpack(view, copy=True)
    # What the view already is is fine, and so are the other arguments of the standard.
    for kwargs in ({"copy": False}, {"dl_device": (1, 0)}, {"max_version": (1, 0)}, {"stream": None}):
        view.__dlpack__(**kwargs)


# --- lifetimes ----------------------------------------------------------------------------------


def test_the_consumer_keeps_the_view_until_it_drops_its_array(backing):
    view = host_view(backing)
    ref = weakref.ref(view)
    got = np.from_dlpack(view)
    del view
    assert not released(ref), "the capsule's owner went while a consumer still had the array"
    del got
    assert released(ref)


def test_an_unconsumed_capsule_releases_the_view(backing):
    view = host_view(backing)
    ref = weakref.ref(view)
    capsule = view.__dlpack__()
    assert 'capsule object "dltensor"' in repr(capsule)
    del view
    assert not released(ref)
    del capsule
    assert released(ref)


def test_an_array_dropped_on_another_thread_releases_the_view(backing):
    view = host_view(backing)
    ref = weakref.ref(view)
    box = [np.from_dlpack(view)]
    del view
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert released(ref)


def test_many_exports_each_release(backing):
    view = host_view(backing, dtype="int32")
    ref = weakref.ref(view)
    arrays = [np.from_dlpack(view) for _ in range(100)] + [view.__dlpack__() for _ in range(100)]
    del view
    del arrays[:150]
    assert not released(ref)
    del arrays
    assert released(ref)


# A consumer lets go of a capsule or an imported array while an exception propagates: the
# exception must come through unchanged (a deleter or destructor written in Python would turn it
# into SystemError and print an "Exception ignored" report, which pytest turns into an error).
no_unraisable = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@no_unraisable
def test_an_exception_while_a_consumer_frees_an_array_comes_through(backing):
    view = host_view(backing)
    ref = weakref.ref(view)
    with pytest.raises(ValueError, match="broadcast"):
        np.add(np.from_dlpack(view), np.zeros(3))  # the imported temporary goes as the error propagates
    del view
    assert released(ref)


@no_unraisable
def test_a_consumer_refusing_the_capsule_raises_its_own_error(backing):
    view = host_view(backing, dtype="bfloat16")  # numpy has no bfloat16: it refuses the capsule
    ref = weakref.ref(view)
    with pytest.raises(Exception) as info:
        np.from_dlpack(view)
    assert not isinstance(info.value, SystemError), info.value
    del view, info
    assert released(ref)


def test_expert_view_groups_three_parts(backing):
    gate, up, down = (host_view(backing[i * 16 : (i + 1) * 16]) for i in range(3))
    expert = ExpertView(gate, up, down)
    assert expert.parts == (gate, up, down) and list(expert) == [gate, up, down]
    assert [int(np.from_dlpack(part)[0]) for part in expert] == [0, 16, 32]
    assert repr(expert).startswith("ExpertView(gate=TensorView(")


def read_capsule(capsule) -> dict:
    """The DLTensor fields of an unconsumed capsule, as a consumer would read them."""
    t = _dlpack._Tensor.from_address(_dlpack._capsule_pointer(capsule, b"dltensor"))
    return {
        "data": t.data or 0,
        "device": (t.device.device_type, t.device.device_id),
        "ndim": t.ndim,
        "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        "shape": tuple(t.shape[i] for i in range(t.ndim)),
        "strides": tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None,
        "byte_offset": t.byte_offset,
    }


@pytest.mark.parametrize(
    "dtype, shape, nbytes, code, strides",
    [
        (None, None, 64, (1, 8, 1), (1,)),
        ("float16", (4, 8), 64, (2, 16, 1), (8, 1)),
        ("int32", (2, 2, 4), 64, (0, 32, 1), (8, 4, 1)),
        ("bfloat16", (32,), 64, (4, 16, 1), (1,)),
        ("float64", (), 8, (2, 64, 1), None),  # a 0-d tensor: strides may be NULL
    ],
)
def test_the_capsule_fields(dtype, shape, nbytes, code, strides):
    view = TensorView(0x7000_0100, nbytes, cuda=True, device_id=3, dtype=dtype, shape=shape)
    fields = read_capsule(view.__dlpack__(stream=-1))
    assert fields == {
        "data": 0x7000_0100,
        "device": (2, 3),
        "ndim": len(view.shape),
        "dtype": code,
        "shape": view.shape,
        "strides": strides,
        "byte_offset": 0,
    }
    host = read_capsule(TensorView(0x7000_0100, nbytes, cuda=False, dtype=dtype, shape=shape).__dlpack__())
    assert host == {**fields, "device": (1, 0)}


def test_a_device_capsule_releases_the_view():
    view = TensorView(0x7000_0100, 64, cuda=True)
    ref = weakref.ref(view)
    capsule = view.__dlpack__(stream=-1)
    del view
    assert not released(ref)
    del capsule
    assert released(ref)


# --- host backend: torch (CPU) ------------------------------------------------------------------


def test_torch_shares_the_memory(backing):
    torch = pytest.importorskip("torch")
    view = host_view(backing, dtype="float16", shape=(4, 8))
    ref = weakref.ref(view)
    tensor = torch.from_dlpack(view)
    assert tensor.dtype == torch.float16 and tuple(tensor.shape) == (4, 8) and tensor.device.type == "cpu"
    assert tensor.data_ptr() == backing.ctypes.data
    backing[:2] = 0
    assert tensor[0, 0].item() == 0.0
    del view, tensor
    assert released(ref)


@no_unraisable
def test_torch_freeing_a_tensor_while_an_exception_propagates(backing):
    torch = pytest.importorskip("torch")
    view = host_view(backing)
    ref = weakref.ref(view)
    with pytest.raises(RuntimeError):
        torch.add(torch.from_dlpack(view), torch.zeros(3, dtype=torch.uint8))  # sizes 64 and 3
    del view
    assert released(ref)


def test_torch_as_tensor_shares_the_memory(backing):
    torch = pytest.importorskip("torch")
    view = host_view(backing)
    try:
        tensor = torch.as_tensor(view)
    except (TypeError, RuntimeError) as exc:  # as_tensor takes __dlpack__ objects in recent torch only
        pytest.skip(f"torch {torch.__version__}'s as_tensor does not take DLPack objects: {exc}")
    assert tensor.data_ptr() == backing.ctypes.data and tensor.dtype == torch.uint8


def test_torch_takes_bfloat16(backing):
    torch = pytest.importorskip("torch")
    view = host_view(backing, dtype="bfloat16", shape=(4, 8))
    tensor = torch.from_dlpack(view)
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == (4, 8)
    assert tensor.data_ptr() == backing.ctypes.data
    assert tensor.view(torch.uint8).numpy().tobytes() == backing.tobytes()


# --- CUDA views against a fake runtime: which waits are enqueued, on which device -----------------


class FakeRuntime:
    """What views.py calls of cuda.bindings.runtime, recording the calls."""

    cudaEventDisableTiming = 2

    def __init__(self, current_device: int = 0):
        self.current = current_device
        self.calls = []
        self.created = 0

    def cudaGetDevice(self):
        return 0, self.current

    def cudaSetDevice(self, device):
        self.calls.append(("set_device", device))
        self.current = device
        return (0,)

    def cudaEventCreateWithFlags(self, flags):
        assert flags == self.cudaEventDisableTiming
        self.created += 1
        return 0, ("event", self.created, self.current)

    def cudaEventRecord(self, event, stream):
        self.calls.append(("record", event, stream, self.current))
        return (0,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event, flags, self.current))
        return (0,)

    def cudaEventDestroy(self, event):
        self.calls.append(("destroy", event))
        return (0,)

    def waits(self):
        """(producer stream, consumer stream) of each wait enqueued, on the event just recorded."""
        out = []
        for record, wait in zip(self.calls, self.calls[1:]):
            if record[0] == "record" and wait[0] == "wait":
                assert wait[2] == record[1] and wait[3] == 0
                out.append((record[2], wait[1]))
        return out


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(views, "runtime", lambda: rt)
    saved = getattr(views._local, "events", None)
    views._local.events = None  # this thread starts with no event (a real one may be there)
    yield rt
    views._local.events = saved  # the fake events go while the fake runtime is still in place


def fake_cuda_view(stream, device_id=0, **kwargs) -> TensorView:
    # An address nobody reads: these capsules are dropped unconsumed.
    return TensorView(0x7000_0000, 64, cuda=True, device_id=device_id, stream=stream, **kwargs)


@pytest.mark.parametrize(
    "producer, consumer, wait",
    [
        (0, None, None),
        (0, 1, None),
        (1, None, None),
        (0, 0, None),  # all the legacy default stream
        (0, -1, None),
        (7, -1, None),  # -1: do not synchronize
        (7, 7, None),
        (2, 2, None),  # the same stream
        (7, None, (7, 1)),
        (7, 1, (7, 1)),
        (7, 2, (7, 2)),
        (7, 9, (7, 9)),
        (0, 9, (1, 9)),
        (0, 2, (1, 2)),  # 0 recorded as cudaStreamLegacy
    ],
)
def test_the_consumer_stream_waits_for_the_view_stream(fake, producer, consumer, wait):
    view = fake_cuda_view(producer)
    capsule = view.__dlpack__(stream=consumer)
    assert 'capsule object "dltensor"' in repr(capsule)
    assert fake.waits() == ([wait] if wait else [])
    del capsule


def test_a_stream_object_is_a_consumer_stream(fake):
    class Stream:
        def __cuda_stream__(self):
            return (0, 9)

    fake_cuda_view(7).__dlpack__(stream=Stream())
    assert fake.waits() == [(7, 9)]
    with pytest.raises(ValueError):
        fake_cuda_view(7).__dlpack__(stream=-2)


def test_the_view_stream_is_the_latest_one_set(fake):
    view = fake_cuda_view(7)
    view.stream = 8  # what the cache does when it serves the expert again on another stream
    view.__dlpack__(stream=9)
    assert fake.waits() == [(8, 9)]


def test_the_wait_is_enqueued_on_the_views_device(fake):
    fake.current = 1
    fake_cuda_view(7, device_id=3).__dlpack__(stream=9)
    assert fake.calls[0] == ("set_device", 3)
    assert fake.calls[1][0] == "record" and fake.calls[1][3] == 3 and fake.calls[2][4] == 3
    assert fake.calls[-1] == ("set_device", 1) and fake.current == 1
    fake.calls.clear()
    fake.current = 3
    fake_cuda_view(7, device_id=3).__dlpack__(stream=9)
    assert [c[0] for c in fake.calls] == ["record", "wait"]  # already there: no switch


def test_one_event_per_thread_and_device(fake):
    view = fake_cuda_view(7)
    for consumer in (8, 9, 10):
        view.__dlpack__(stream=consumer)
    assert fake.created == 1
    assert len({call[1] for call in fake.calls if call[0] == "record"}) == 1
    fake_cuda_view(7, device_id=1).__dlpack__(stream=8)
    assert fake.created == 2

    def other_thread():
        view.__dlpack__(stream=8)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert fake.created == 3
    for _ in range(100):  # the thread's event goes with the thread's locals, as it ends
        gc.collect()
        if ("destroy", ("event", 3, 0)) in fake.calls:
            break
        time.sleep(0.01)
    assert ("destroy", ("event", 3, 0)) in fake.calls


def test_a_host_view_never_touches_cuda(fake, backing):
    host_view(backing, stream=7).__dlpack__(stream=9)
    assert fake.calls == [] and fake.created == 0


def test_cuda_array_interface(fake):
    view = fake_cuda_view(0, device_id=2, dtype="float16", shape=(4, 8))
    assert view.__dlpack_device__() == (2, 2)
    assert hasattr(view, "__cuda_array_interface__") and not hasattr(view, "__array_interface__")
    assert view.__cuda_array_interface__ == {
        "shape": (4, 8),
        "typestr": "<f2",
        "data": (0x7000_0000, False),
        "version": 3,
        "strides": None,
        "stream": 1,
    }
    view.stream = 7
    assert view.__cuda_array_interface__["stream"] == 7
    assert "device=cuda:2" in repr(view)
    with pytest.raises(AttributeError, match="bfloat16"):  # hasattr() is False: consumers go on to DLPack
        _ = fake_cuda_view(7, dtype="bfloat16").__cuda_array_interface__
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device=(2, 0))  # another GPU
    assert fake.calls == []  # refused before any wait


# --- CUDA: real device memory, real consumers ---------------------------------------------------


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _cupy():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, or no usable CUDA under it
        return None


HAVE_DEVICE = _cuda.device_count() > 0
TORCH = _torch_cuda() if HAVE_DEVICE else None
CUPY = _cupy() if HAVE_DEVICE else None
needs_device = pytest.mark.skipif(
    not (HAVE_DEVICE and (TORCH or CUPY)),
    reason="needs a CUDA device through cuda-python and PyTorch or CuPy with CUDA",
)
needs_torch = pytest.mark.skipif(TORCH is None, reason="needs a CUDA device and PyTorch with CUDA")
needs_cupy = pytest.mark.skipif(CUPY is None, reason="needs a CUDA device and CuPy")


@pytest.fixture
def device():
    """(runtime, address of 256 device bytes holding `host`, host, stream the bytes are on, another stream)."""
    rt = _cuda.runtime()
    _cuda.check(rt.cudaSetDevice(0), "cudaSetDevice")
    host = np.random.default_rng(7).integers(0, 256, 256, dtype=np.uint8)
    ptr = int(_cuda.check(rt.cudaMalloc(host.nbytes), "cudaMalloc"))
    streams = [
        int(_cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")) for _ in range(2)
    ]
    _cuda.check(
        rt.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy"
    )
    yield rt, ptr, host, *streams
    _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    for s in streams:
        rt.cudaStreamDestroy(s)
    rt.cudaFree(ptr)


def device_bytes(rt, ptr: int, n: int) -> bytes:
    out = np.empty(n, np.uint8)
    _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    _cuda.check(rt.cudaMemcpy(out.ctypes.data, ptr, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
    return out.tobytes()


@needs_device
@needs_torch
@pytest.mark.parametrize("dtype, shape", [(None, None), ("float16", (8, 16)), ("int32", (64,))])
def test_torch_from_dlpack_on_device(device, dtype, shape):
    torch = TORCH
    rt, ptr, host, stream, _ = device
    view = TensorView(ptr, host.nbytes, cuda=True, stream=stream, dtype=dtype, shape=shape)
    ref = weakref.ref(view)
    tensor = torch.from_dlpack(view)  # torch passes its current stream: the legacy one, 1
    assert tensor.device == torch.device("cuda", 0) and tensor.data_ptr() == ptr
    assert tuple(tensor.shape) == view.shape
    assert tensor.cpu().numpy().tobytes() == host.tobytes()
    tensor.view(torch.uint8).fill_(7)  # writes land in the view's own bytes
    torch.cuda.synchronize()
    assert device_bytes(rt, ptr, host.nbytes) == bytes([7]) * host.nbytes
    del view, tensor
    assert released(ref)


@needs_device
@needs_torch
def test_torch_bfloat16_on_device(device):
    torch = TORCH
    rt, ptr, host, stream, _ = device
    tensor = torch.from_dlpack(TensorView(ptr, host.nbytes, cuda=True, stream=stream, dtype="bfloat16"))
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == (128,) and tensor.data_ptr() == ptr
    assert tensor.view(torch.int16).cpu().numpy().tobytes() == host.tobytes()


@needs_device
@needs_torch
def test_torch_as_tensor_through_the_cuda_array_interface(device):
    torch = TORCH
    rt, ptr, host, stream, _ = device
    view = TensorView(ptr, host.nbytes, cuda=True, stream=stream, dtype="float16", shape=(4, 32))
    assert view.__cuda_array_interface__["stream"] == stream
    tensor = torch.as_tensor(view)
    assert tensor.device.type == "cuda" and tensor.data_ptr() == ptr and tensor.dtype == torch.float16
    assert tuple(tensor.shape) == (4, 32)
    assert tensor.cpu().numpy().tobytes() == host.tobytes()


@needs_device
@needs_cupy
def test_cupy_on_device(device):
    cupy = CUPY
    rt, ptr, host, stream, _ = device
    view = TensorView(ptr, host.nbytes, cuda=True, stream=stream, dtype="uint16", shape=(2, 64))
    for array in (cupy.from_dlpack(view), cupy.asarray(view)):  # DLPack, then the CUDA Array Interface
        assert array.data.ptr == ptr and array.shape == (2, 64) and array.dtype == np.uint16
        assert cupy.asnumpy(array).tobytes() == host.tobytes()


@needs_device
def test_dlpack_stream_arguments_on_device(device):
    rt, ptr, host, stream, other = device
    for producer in (stream, 0):
        view = TensorView(ptr, host.nbytes, cuda=True, stream=producer)
        for consumer in (other, -1, None, 1, 2, stream, 0):
            capsule = view.__dlpack__(stream=consumer)
            assert 'capsule object "dltensor"' in repr(capsule)
            del capsule  # unconsumed: released by its destructor
    assert list(views._local.events) == [0]  # one event of this thread's, for device 0, reused
    _cuda.check(rt.cudaStreamSynchronize(other), "cudaStreamSynchronize")
    _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def _query(rt, stream: int):
    result = rt.cudaStreamQuery(stream)
    return result[0] if isinstance(result, tuple) else result


@needs_device
@needs_torch
def test_the_consumer_stream_really_waits(device):
    """Work still running on the view's stream holds back the consumer's stream after
    __dlpack__(stream=consumer), without blocking the host."""
    torch = TORCH
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep to keep a stream busy")
    rt, ptr, host, stream, other = device
    view = TensorView(ptr, host.nbytes, cuda=True, stream=stream)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        torch.cuda._sleep(1 << 30)  # about half a second of spinning on the view's stream
    view.__dlpack__(stream=other)  # returns at once: the wait is enqueued, not done
    assert _query(rt, other) == rt.cudaError_t.cudaErrorNotReady, "the consumer's stream did not wait"
    _cuda.check(rt.cudaStreamSynchronize(other), "cudaStreamSynchronize")
    assert _query(rt, stream) == rt.cudaError_t.cudaSuccess, "the consumer's stream finished before the view's work"

"""GPU-side waits for, and writes of, 32-bit flags in page-locked host memory: CUDA's stream
memory operations (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``) through the driver,
and the copies between them (``cuMemcpyAsync``, :func:`copy_bytes`; ``cuMemcpy2DAsync``,
:func:`copy_rows`).

Why. A stream can wait for another process's work through an IPC event only once that
process's host has recorded the event, so the waiting host must first learn that it has: the
two hosts move in step. A flag in shared host memory that the writer's stream sets after its
copy, and that the reader's stream waits for, needs neither host: the reader issues its wait
whenever it likes and the GPU polls the flag. PyTorch does not expose these operations, so
they are called through ``libcuda`` with ``ctypes`` on the streams' own handles.

Values are 32-bit and compared cyclically (``GEQ``: ``(int32)(*flag - value) >= 0``), so a
counter that wraps past 2^32 still compares right while the values it is compared against
stay within 2^31 of it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ, cyclic
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: earlier writes of the stream land first
_REGISTER_PORTABLE_MAPPED = 0x3  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: an address of the unified space, host or device


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    for name, args in (
        ("cuStreamWaitValue32_v2", [ctypes.c_void_p, u64, u32, ctypes.c_uint]),
        ("cuStreamWriteValue32_v2", [ctypes.c_void_p, u64, u32, ctypes.c_uint]),
        ("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_uint]),
        ("cuMemcpyAsync", [u64, u64, ctypes.c_size_t, ctypes.c_void_p]),
        ("cuMemcpy2DAsync_v2", [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]),
    ):
        getattr(driver, name).argtypes = args
        getattr(driver, name).restype = ctypes.c_int
    return driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


class HostFlags:
    """``count`` 32-bit flags at the start of ``page`` (a shared host mapping of at least
    ``4 * count`` bytes, viewed as a uint8 tensor), which this page-locks and registers for
    the current device's streams; zero until a stream writes them."""

    def __init__(self, page: torch.Tensor, count: int) -> None:
        if page.numel() < 4 * count:
            raise ValueError(f"{count} flags need {4 * count} bytes, the page has {page.numel()}")
        self._page = page  # registered: kept mapped while the flags live
        err = torch.cuda.cudart().cudaHostRegister(
            page.data_ptr(), page.numel(), _REGISTER_PORTABLE_MAPPED
        )
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the flags' page failed: cudaError {int(err)}")
        address = ctypes.c_uint64()
        _check(
            _driver().cuMemHostGetDevicePointer_v2(ctypes.byref(address), page.data_ptr(), 0),
            "cuMemHostGetDevicePointer",
        )
        self._base, self.count = address.value, count

    def _at(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(f"flag {index} of {self.count}")
        return self._base + 4 * index

    def wait(self, stream: torch.cuda.Stream, index: int, value: int) -> None:
        """``stream``'s later work waits until flag ``index`` reaches ``value`` (cyclic)."""
        _check(
            _driver().cuStreamWaitValue32_v2(
                stream.cuda_stream, self._at(index), value & 0xFFFFFFFF, _WAIT_GEQ
            ),
            "cuStreamWaitValue32",
        )

    def write(self, stream: torch.cuda.Stream, index: int, value: int) -> None:
        """``stream`` sets flag ``index`` to ``value`` once its earlier work is done and its
        writes are visible."""
        _check(
            _driver().cuStreamWriteValue32_v2(
                stream.cuda_stream, self._at(index), value & 0xFFFFFFFF, _WRITE_DEFAULT
            ),
            "cuStreamWriteValue32",
        )


def copy_bytes(stream: torch.cuda.Stream, destination: int, source: int, nbytes: int) -> None:
    """``stream`` copies ``nbytes`` from address ``source`` to ``destination`` (device memory
    or registered host memory: unified addressing tells the direction), as ``Tensor.copy_``
    of contiguous tensors of one dtype does through ``cudaMemcpyAsync``, without its dispatch
    (a few microseconds of host time a copy, where a staged transfer makes one per piece and
    payload tensor on the writer, one per piece and read on each reader).
    ``stream``'s later work, a flag write among it, follows the copy."""
    _check(
        _driver().cuMemcpyAsync(destination, source, nbytes, stream.cuda_stream), "cuMemcpyAsync"
    )


def copy_rows(
    stream: torch.cuda.Stream,
    destination: int,
    destination_pitch: int,
    source: int,
    source_pitch: int,
    width: int,
    height: int,
) -> None:
    """``stream`` copies ``height`` rows of ``width`` bytes, each ``source_pitch`` bytes after
    the previous one at ``source``, to rows ``destination_pitch`` apart at ``destination``
    (``cuMemcpy2DAsync``: one copy-engine transfer; addresses as :func:`copy_bytes`'s)."""
    copy = _Memcpy2D(
        srcMemoryType=_UNIFIED,
        srcDevice=source,
        srcPitch=source_pitch,
        dstMemoryType=_UNIFIED,
        dstDevice=destination,
        dstPitch=destination_pitch,
        WidthInBytes=width,
        Height=height,
    )
    _check(_driver().cuMemcpy2DAsync_v2(ctypes.byref(copy), stream.cuda_stream), "cuMemcpy2DAsync")

"""The worker's CUDA streams for SBO and DBO: one data stream for input copies, 1-4 compute streams.

A step's inputs are built on the staging thread into pinned host memory and copied to the device
on the data stream; an event recorded after the last copy is what the step's compute stream waits
for, so the copies of step k+1 run while step k computes and nothing on the host waits for them.
Each DBO lane computes on its own compute stream (lane % `compute_streams`), so a prefill-heavy
batch and a decode batch in flight run concurrently on the GPU.

Pinned host buffers come from torch's caching host allocator: a buffer is reused once the copy
that read it has completed (the allocator records an event on the copy), never before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[float] | Sequence[int], device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`; onto a GPU through pinned memory, queued on the current
    stream without waiting (a plain host-to-device copy first waits for all the stream's work)."""
    host = (
        torch.from_numpy(np.ascontiguousarray(values))
        if isinstance(values, np.ndarray)
        else torch.tensor(values)
    )
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class CudaStreams:
    """The data stream and the compute streams of one CUDA worker."""

    def __init__(self, device: torch.device, compute_streams: int) -> None:
        assert device.type == "cuda", f"CUDA streams on {device}"
        assert 1 <= compute_streams <= 4, f"compute_streams {compute_streams} outside 1..4"
        self.device = device
        self.data = torch.cuda.Stream(device)
        self.compute = [torch.cuda.Stream(device) for _ in range(compute_streams)]

    def slot_for_lane(self, lane: int) -> int:
        return lane % len(self.compute)

    def for_lane(self, lane: int) -> torch.cuda.Stream:
        return self.compute[self.slot_for_lane(lane)]


class DeviceUpload:
    """One step's host arrays → device tensors: pinned staging copies, issued on the data stream.

    Call it once per array (it is build_forward_batch's `upload`), then `ready()` for the event the
    compute stream waits on. Each device tensor is marked as used by `consumer`, so the allocator
    does not hand its memory to a later step's copies while this step still reads it.
    """

    def __init__(self, streams: CudaStreams, consumer: torch.cuda.Stream) -> None:
        self.streams = streams
        self.consumer = consumer

    def __call__(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        source = torch.from_numpy(np.ascontiguousarray(array))
        host = torch.empty(source.shape, dtype=dtype, pin_memory=True)
        host.copy_(source)
        with torch.cuda.stream(self.streams.data):
            device = host.to(self.streams.device, non_blocking=True)
        device.record_stream(self.consumer)
        return device

    def ready(self) -> torch.cuda.Event:
        """An event that completes once every copy issued so far has landed."""
        event = torch.cuda.Event()
        event.record(self.streams.data)
        return event

"""What the torch backend needs on a GPU so that a load never slows the serving version:
streams by role, bounded pinned staging for loads, per-thread pinned I/O, and a pool of
captured CUDA graphs.

* torch hands out streams from one pool per priority, all non-blocking (they never wait
  on the legacy default stream). Loads and inference draw from different priorities, so
  a load's copies never share a stream with an inference thread, and the GPU schedules
  inference kernels first.
* A CUDA graph replays a request's whole chain of kernels with one launch: batch-1
  requests of an MLP are a few microseconds of GPU work each, and without graphs every
  kernel launch is a trip through Python holding the GIL, which the event loop and the
  other inference threads wait for.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

LOAD_PRIORITY = 0  # torch's default priority: the low one
INFERENCE_PRIORITY = -1  # higher; the GPU runs these kernels first
CHUNK_BYTES = 8 * 2**20  # per staging buffer; two per load are pinned at once
ALIGN = 256  # byte alignment of each tensor inside the pinned I/O buffers


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pieces(total: int, room: int, chunk: int) -> Iterator[int]:
    """Lengths that cut ``total`` bytes at staging-buffer ends: the first piece fills the
    ``room`` left in the current buffer, the others at most ``chunk`` each."""
    while total > 0:
        if room == 0:
            room = chunk
        piece = min(total, room)
        yield piece
        total -= piece
        room -= piece


HOST_PIN = "cuda-host-register"  # the owner of a private copy's CUDA registration
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def register_host(torch: Any, address: int, size: int) -> bool:
    """Register ``size`` bytes at ``address`` with CUDA as pinned memory, so copies from
    them go by DMA with no staging copy; False where the driver refuses (a copy is then
    staged, as any pageable memory)."""
    # portable: pinned for every CUDA context, whichever device this thread is on (the
    # engine's may be another) and whichever thread undoes it
    code = torch.cuda.cudart().cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE)
    if int(code) != 0:
        log.warning("cudaHostRegister of %d bytes refused (error %s): staged copies", size, code)
        return False
    return True


def unregister_host(torch: Any, address: int) -> None:
    code = torch.cuda.cudart().cudaHostUnregister(address)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostUnregister failed (error {code})")


class StagedUpload:
    """Copies host bytes into tensors through two reused staging buffers of
    ``chunk_bytes`` (pinned, on ``stream``, when there is one): while the DMA drains one
    buffer the host fills the other, and a buffer is refilled only once the copies out of
    it are done (an event per buffer), so no more than ``2 * chunk_bytes`` is ever pinned
    and no copy on the link is longer than a chunk. Without a stream (the CPU) the same
    steps run on plain memory, which is how they are tested without a GPU.

    ``pinned`` (an address and a length): host memory registered with CUDA (a private
    copy, :func:`register_host`); a source inside it is copied to the device straight
    from there, a chunk at a time, with no staging copy on the host."""

    def __init__(
        self,
        torch: Any,
        chunk_bytes: int,
        stream: Any = None,
        pinned: tuple[int, int] | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        self._torch = torch
        self._stream = stream
        self._gpu = stream is not None
        self._pinned = pinned if self._gpu else None
        self._sources: list[Any] = []  # direct copies' sources: alive until finish()
        self.direct_bytes = 0  # copied with no staging (for tests and benchmarks)
        self._chunk = chunk_bytes
        self._buffers = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self._gpu) for _ in range(2)
        ]
        self._hosts = [buffer.numpy() for buffer in self._buffers]
        self._drained = [torch.cuda.Event() if self._gpu else None for _ in range(2)]
        self._current = 0
        self._used = 0  # bytes of the current buffer already handed to copies
        self.pieces = 0  # copies issued (for tests and benchmarks)

    def _next_buffer(self) -> None:
        done = self._drained[self._current]
        if done is not None:
            done.record(self._stream)
        self._current ^= 1
        self._used = 0
        refill = self._drained[self._current]
        if refill is not None:
            refill.synchronize()  # the copies out of this buffer, not the device

    def copy(self, target: Any, source: memoryview) -> None:
        """Copy ``source`` into the (contiguous) tensor ``target``, byte for byte; numpy
        does the host copies, which release the GIL."""
        if source.nbytes != target.numel() * target.element_size():
            raise ValueError(f"{source.nbytes} bytes do not fill a tensor of {target.shape}")
        into = target.reshape(-1).view(self._torch.uint8)
        into_host = None if self._gpu else into.numpy()
        src = np.frombuffer(source, dtype=np.uint8)
        if self._registered(src):
            self._copy_direct(into, src)
            return
        done = 0
        for piece in pieces(src.size, self._chunk - self._used, self._chunk):
            if self._used == self._chunk:
                self._next_buffer()
            at = self._used
            staged = self._hosts[self._current][at : at + piece]
            np.copyto(staged, src[done : done + piece])
            if into_host is None:  # queued on the load's stream; refilled after it ran
                into[done : done + piece].copy_(
                    self._buffers[self._current][at : at + piece], non_blocking=True
                )
            else:
                np.copyto(into_host[done : done + piece], staged)
            self._used += piece
            done += piece
            self.pieces += 1

    def _registered(self, src: np.ndarray) -> bool:
        if self._pinned is None or src.size == 0:
            return False
        base, length = self._pinned
        start = int(src.ctypes.data)
        return base <= start and start + src.size <= base + length

    def _copy_direct(self, into: Any, src: np.ndarray) -> None:
        """Queue ``src`` (registered memory) to ``into`` on the load's stream, a chunk per
        copy (no copy on the link longer than a staged one)."""
        with warnings.catch_warnings():  # read-only bytes: they are only read
            warnings.simplefilter("ignore", UserWarning)
            host = self._torch.from_numpy(src)
        self._sources.append(host)
        for at in range(0, src.size, self._chunk):
            end = min(src.size, at + self._chunk)
            into[at:end].copy_(host[at:end], non_blocking=True)
            self.pieces += 1
        self.direct_bytes += src.size

    def finish(self) -> None:
        """Wait for this upload's stream (the load's only wait); the buffers go back to
        torch's pinned-memory cache when this object is dropped, and the direct copies'
        sources are let go (their bytes may be released from here on)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._sources.clear()


class ThreadIO:
    """One inference thread's stream and its pinned buffer for inputs and outputs."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self.stream = torch.cuda.Stream(device=device, priority=INFERENCE_PRIORITY)
        self._buffer = torch.empty(0, dtype=torch.uint8, pin_memory=True)

    def host(self, nbytes: int) -> Any:
        """At least ``nbytes`` of pinned memory. The thread's previous request
        synchronized its stream, so nothing reads the old buffer any more; within a
        request, outputs may reuse the inputs' bytes, since the stream copies those in
        before it copies any output out."""
        if self._buffer.numel() < nbytes:
            size = max(nbytes, 2 * self._buffer.numel(), 1 << 16)
            self._buffer = self._torch.empty(size, dtype=self._torch.uint8, pin_memory=True)
        return self._buffer


class PerThreadIO:
    """ThreadIO by thread, made on a thread's first request; shared by the engines of a
    backend (a thread runs one request at a time)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device
        self._local = threading.local()

    def get(self) -> ThreadIO:
        io: ThreadIO | None = getattr(self._local, "io", None)
        if io is None:
            io = self._local.io = ThreadIO(self._torch, self._device)
        return io


@dataclass
class Captured:
    """A request's kernels captured for fixed input shapes, with the tensors the graph
    reads and writes and pinned host tensors (and numpy views of them) to stage through.
    Two CUDA events time each replay on the GPU (:attr:`gpu_seconds`): a host clock
    around it would also time the thread's waits for the GIL, which say nothing of the
    GPU. ``whole``: the copies in and out and both events are inside the graph, so a
    replay is a numpy copy in, one torch call and a numpy copy out, and no host step
    falls between the events; otherwise (a runtime that refused such a capture) the
    copies and the events are queued around the graph's launch, four more torch calls."""

    graph: Any
    inputs: dict[str, Any]  # device tensors the graph reads
    outputs: list[Any]  # device tensors the graph writes
    host_inputs: dict[str, tuple[Any, np.ndarray]]  # pinned tensor and its numpy view
    host_outputs: list[tuple[Any, np.ndarray]]
    started: Any = None  # timing events (None: replays are not timed)
    finished: Any = None
    gpu_seconds: float | None = None  # the last replay's, copies in and out included
    whole: bool = False  # copies and events captured in the graph

    def run(
        self, torch: Any, stream: Any, arrays: Mapping[str, np.ndarray], specs: Sequence[Any]
    ) -> dict[str, np.ndarray]:
        """One request on ``stream``: valid for the shapes this graph was captured for."""
        for name, array in arrays.items():
            np.copyto(self.host_inputs[name][1], array)
        timed = self.started is not None and self.finished is not None
        with torch.cuda.stream(stream):
            if self.whole:
                self.graph.replay()
            else:
                if timed:
                    self.started.record(stream)
                _copy_in(self.inputs, self.host_inputs)
                self.graph.replay()
                _copy_out(self.outputs, self.host_outputs)
                if timed:
                    self.finished.record(stream)
            stream.synchronize()  # the one wait of a request, on this thread's stream
        if timed:
            self._read_time()
        return {
            spec.name: view.copy() for spec, (_, view) in zip(specs, self.host_outputs, strict=True)
        }

    def _read_time(self) -> None:
        """The replay's GPU time, once its stream is synchronized. Timing must never fail
        a request whose outputs are ready: a runtime that refuses the events' time
        leaves this graph untimed (and quick runs to the times of the others)."""
        try:
            self.gpu_seconds = self.started.elapsed_time(self.finished) / 1000  # ms
        except (RuntimeError, ValueError) as exc:
            log.warning("a graph's replays are no longer timed: %s", exc)
            self.started = self.finished = self.gpu_seconds = None


ShapeKey = tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass
class GraphPool:
    """Captured graphs by input shapes. A request borrows one for its shapes and gives it
    back: a graph's tensors serve one request at a time. Up to ``per_shape`` graphs exist
    for a shape (concurrent requests of it) and up to ``max_shapes`` shapes are captured;
    a request finding none free, and no room for another, runs without one."""

    per_shape: int
    max_shapes: int
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _free: dict[ShapeKey, list[Captured]] = field(default_factory=dict)
    _made: dict[ShapeKey, int] = field(default_factory=dict)  # captured or being captured
    _closed: bool = False

    def borrow(self, key: ShapeKey) -> Captured | None:
        """A free graph for ``key``, or None: run without a graph. Graphs are captured at
        warm-up only (:meth:`reserve`), never on a request's thread: a capture there,
        beside other threads' copies and replays, left the CUDA context broken
        (``cudaErrorInvalidAddressSpace`` from then on) once dynamic batching sent
        batches of many sizes."""
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def reserve(self, key: ShapeKey) -> bool:
        """Take the place of one more graph for ``key`` if there is room (warm-up)."""
        with self._lock:
            return self._reserve(key)

    def _reserve(self, key: ShapeKey) -> bool:
        made = self._made.get(key, 0)
        room = made < self.per_shape and (made > 0 or len(self._made) < self.max_shapes)
        if self._closed or not room:
            return False
        self._made[key] = made + 1
        return True

    def give_back(self, key: ShapeKey, captured: Captured | None) -> None:
        """Return a borrowed graph (or a new one); ``None``: a capture that failed, whose
        place stays taken."""
        if captured is None:
            return
        with self._lock:
            if not self._closed:
                self._free.setdefault(key, []).append(captured)

    def count(self) -> int:
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def close(self) -> None:
        """Drop every graph (their memory goes back to torch's allocator)."""
        with self._lock:
            self._closed = True
            self._free.clear()


def _pinned(torch: Any, shape: tuple[int, ...], dtype: Any) -> tuple[Any, np.ndarray]:
    tensor = torch.empty(shape, dtype=dtype, pin_memory=True)
    return tensor, tensor.numpy()


def capture(
    torch: Any,
    stream: Any,
    run: Callable[[dict[str, Any]], list[Any]],
    arrays: Mapping[str, np.ndarray],
    results: Sequence[Any],
    device: Any,
) -> Captured:
    """Capture ``run`` (the graph's kernels, from input tensors to output tensors) for the
    shapes of ``arrays`` on ``stream``, which has just run them (``results``: what they
    gave, for the shapes of the output buffers). The whole request is captured
    (:func:`_capture_whole`) unless this torch has no ``external`` events or the
    runtime cannot time events a graph records; then its kernels alone. A failure inside
    a capture is not retried the other way: torch's ``capture_end`` raising leaves the
    allocator's capture state behind, so the caller goes without a graph for the shape.
    ``torch.cuda.graph`` is not used: it synchronizes the whole device, runs the garbage
    collector and empties the allocator's cache before every capture. The capture is
    thread-local, so other threads keep launching and synchronizing meanwhile; every
    buffer is allocated before it begins. The pinned buffers are known to torch's host
    allocator on the capture's stream only: safe because every replay synchronizes its
    stream before its graph goes back to the pool."""
    dtypes = {name: getattr(torch, str(a.dtype)) for name, a in arrays.items()}
    inputs = {n: torch.empty(a.shape, dtype=dtypes[n], device=device) for n, a in arrays.items()}
    host_inputs = {n: _pinned(torch, a.shape, dtypes[n]) for n, a in arrays.items()}
    host_outputs = [_pinned(torch, tuple(r.shape), r.dtype) for r in results]
    try:
        events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(2)]
    except TypeError as exc:  # a torch older than external events
        _kernels_alone(f"this torch has no external events ({exc})")
    else:
        for name, array in arrays.items():
            np.copyto(host_inputs[name][1], array)  # the checking replay reads real inputs
        whole = _capture_whole(torch, stream, run, inputs, host_inputs, host_outputs, events)
        try:
            took = whole.started.elapsed_time(whole.finished)
        except (RuntimeError, ValueError) as exc:
            _kernels_alone(f"events recorded by a graph cannot be timed ({exc})")
        else:
            if took > 0:
                return whole
            _kernels_alone(f"events recorded by a graph timed {took} ms")
    graph, outputs = _record(torch, stream, lambda: run(inputs))
    timing = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    return Captured(graph, inputs, outputs, host_inputs, host_outputs, *timing)


_told: set[str] = set()


def _kernels_alone(why: str) -> None:
    """Say once per process why graphs hold their kernels alone: their replays' times
    then include the host's waits between the events (see ``replay_times``)."""
    if why not in _told:
        _told.add(why)
        log.warning("CUDA graphs capture their kernels alone: %s", why)


def _capture_whole(
    torch: Any,
    stream: Any,
    run: Callable[[dict[str, Any]], list[Any]],
    inputs: dict[str, Any],
    host_inputs: dict[str, tuple[Any, np.ndarray]],
    host_outputs: list[tuple[Any, np.ndarray]],
    events: list[Any],
) -> Captured:
    """The copies from the pinned inputs, the kernels, the copies to the pinned outputs
    and, around them, two timing events recorded as the graph's own nodes (``external``):
    a replay is then one launch, and the events' span holds no host step, so the GIL
    waits of a thread at 16 clients no longer count. One replay runs at once, so that
    the caller can check the events' time before the graph is used."""
    started, finished = events

    def request() -> list[Any]:
        started.record(stream)
        _copy_in(inputs, host_inputs)
        outputs = run(inputs)
        _copy_out(outputs, host_outputs)
        finished.record(stream)
        return outputs

    graph, outputs = _record(torch, stream, request)
    with torch.cuda.stream(stream):
        graph.replay()
        stream.synchronize()
    return Captured(
        graph, inputs, outputs, host_inputs, host_outputs, started, finished, whole=True
    )


def _record(torch: Any, stream: Any, body: Callable[[], list[Any]]) -> tuple[Any, list[Any]]:
    """A graph of what ``body`` queues on ``stream`` (thread-local capture), and the
    output tensors it gave."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = body()
        finally:
            graph.capture_end()
    return graph, outputs


def _copy_in(inputs: dict[str, Any], host_inputs: dict[str, tuple[Any, np.ndarray]]) -> None:
    """Queue the pinned inputs' copies to the device tensors the graph reads."""
    for name, (pinned, _) in host_inputs.items():
        inputs[name].copy_(pinned, non_blocking=True)


def _copy_out(outputs: list[Any], host_outputs: list[tuple[Any, np.ndarray]]) -> None:
    """Queue the graph's output tensors' copies to the pinned outputs."""
    for (pinned, _), output in zip(host_outputs, outputs, strict=True):
        pinned.copy_(output, non_blocking=True)

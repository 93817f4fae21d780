"""Each rank's time in DeepSpeed's collectives against its optimizer steps, gathered every window
of steps into the run's ranks.jsonl by global rank 0 (the entry shim installs RankTimes on
deepspeed.comm's backend when it is imported; dscnode.stragglers judges the windows, the
supervisor marks the slow rank). Loaded by every rank: it imports nothing of the package."""
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path


class RankTimes:
    """Each rank's time in DeepSpeed's collectives (every call through deepspeed.comm's backend:
    all-reduce, reduce-scatter, all-gather, broadcast, all-to-all, point-to-point, barrier)
    against its optimizer steps; every window of steps global rank 0 gathers every rank's
    figures into the run's ranks.jsonl, where the supervisor names a rank the others wait for
    (dscnode.stragglers, whose docstring says why the measure holds where collectives overlap
    compute). A collective's span runs from its call to its return, or to its handle's wait()
    where it is asynchronous; a rank's comm time is the union of its spans (overlapping
    collectives count once). On CPU ranks (gloo) the spans are wall time; on GPU ranks, CUDA
    events recorded on the calling stream at both ends, read once they have completed, so that
    nothing waits for the GPU to measure them: the window's gather (a small all_gather_object,
    which waits for the GPU once a window, as any collective does) is all the measurement adds to
    the run's own collectives. Timing starts once an optimizer step has ended after the first
    call (which may come from a micro-step, or the set-up before it). Off with
    DSC_RANK_WINDOW=0."""

    WINDOW_STEPS = 10  # steps a window covers (DSC_RANK_WINDOW overrides it)
    METHODS = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "broadcast", "all_to_all_single", "all_to_all", "gather", "scatter",
               "send", "recv", "isend", "irecv", "barrier", "monitored_barrier")
    OPEN_MAX = 65536  # GPU spans not yet completed that are kept (read every step: never reached)

    def __init__(self, path, window):
        self.path, self.window = Path(path), int(window)
        self.cuda = False  # GPU ranks time their collectives with CUDA events (decided at the first step)
        self.timing = False  # from the first optimizer step on: what comes before it is the engine's set-up
        self.broken = None  # why this rank stopped timing its collectives (said in its figures instead)
        self.origin = None  # GPU: the first completed event, which span positions are measured from
        self.spans, self.open, self.calls = [], [], 0  # (start_s, end_s) this window; GPU event pairs unread
        self.gathered_s = 0.0  # the last gather's wait, comm time of the window after it
        self.handle_type = ()  # torch.distributed.Work: an asynchronous collective's handle
        self.steps, self.step_s, self.last, self.global_step = 0, 0.0, None, None

    @classmethod
    def window_from(cls, value):
        """DSC_RANK_WINDOW's steps (the plan refuses anything but a whole number; set by hand, a
        wrong value is said and the default taken)."""
        if value in (None, ""):
            return cls.WINDOW_STEPS
        try:
            return max(int(value), 0)
        except ValueError:
            print(f"[dsc_node] DSC_RANK_WINDOW={value!r} is not a number of steps: {cls.WINDOW_STEPS} taken",
                  file=sys.stderr)
            return cls.WINDOW_STEPS

    def __call__(self, module):
        backend = module.TorchBackend
        self.handle_type = getattr(sys.modules["torch"].distributed, "Work", ())
        for name in self.METHODS:
            if hasattr(backend, name):
                setattr(backend, name, self.timed(getattr(backend, name)))

    def timed(self, fn):
        hook = self

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            start = hook.span_start() if hook.timing else None
            out = fn(*args, **kwargs)
            if start is None:
                return out
            if hook.handle_type and isinstance(out, hook.handle_type):
                return TimedHandle(out, hook, start)  # asynchronous: its span ends at wait()
            hook.span_end(start)
            return out
        return collective

    def span_start(self):
        """A collective's start: a CUDA event recorded on the calling stream on GPU ranks, the wall
        time on CPU ranks; None once timing broke."""
        try:
            if self.cuda:
                event = sys.modules["torch"].cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()
        except Exception as e:  # noqa: BLE001 - a measurement, never a rank's failure
            self.broke(e)
            return None

    def span_end(self, start):
        """A collective's end (its return, or its handle's wait)."""
        if not self.timing:
            return
        try:
            self.calls += 1
            if self.cuda:
                end = sys.modules["torch"].cuda.Event(enable_timing=True)
                end.record()
                self.open.append((start, end))
                del self.open[:-self.OPEN_MAX]
            else:
                self.spans.append((start, time.perf_counter()))
        except Exception as e:  # noqa: BLE001 - a measurement, never a rank's failure
            self.broke(e)

    def broke(self, e):
        self.timing, self.broken, self.open = False, f"{type(e).__name__}: {e}", []
        print(f"[dsc_node] this rank's collectives are not timed any more: {self.broken}", file=sys.stderr)

    def read_events(self):
        """The spans of the GPU collectives whose events have completed, in seconds from the first
        one; the rest are read at the next step."""
        left = []
        for start, end in self.open:
            if not end.query():
                left.append((start, end))
                continue
            self.origin = self.origin or start
            self.spans.append((self.origin.elapsed_time(start) / 1000, self.origin.elapsed_time(end) / 1000))
        self.open = left

    @staticmethod
    def union(spans):
        """Seconds covered by at least one span."""
        total, reach = 0.0, None
        for start, end in sorted(spans):
            if reach is None or start > reach:
                total, reach = total + max(end - start, 0.0), end
            elif end > reach:
                total, reach = total + end - reach, end
        return total

    def stepped(self, engine):
        """An optimizer step (the engine's step at a gradient-accumulation boundary) has ended. Every
        rank comes here at the same steps, so every rank gathers at the same ones: nothing here
        may make one rank skip a gather the others make (they would wait in it for ever)."""
        if self.global_step is None:  # the first call (a micro-step maybe): what came before is set-up
            self.global_step = engine.global_steps
            return
        if engine.global_steps == self.global_step:
            return  # a micro-step within the accumulation
        now = time.perf_counter()
        self.global_step = engine.global_steps
        if self.last is None:  # the first whole optimizer step ended: timing starts
            torch = sys.modules["torch"]
            self.cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
            self.timing = self.broken is None
        else:
            self.steps += 1
            self.step_s += now - self.last
        self.last = now
        if self.open and self.timing:
            try:
                self.read_events()
            except Exception as e:  # noqa: BLE001 - a measurement, never a rank's failure
                self.broke(e)
        if self.steps and engine.global_steps % self.window == 0:
            self.gather(engine)

    def figures(self, engine):
        """This rank's figures for the window, per optimizer step."""
        if self.broken:
            raise RuntimeError(self.broken)
        step_s, comm_s = self.step_s / self.steps, (self.union(self.spans) + self.gathered_s) / self.steps
        return {"rank": int(engine.global_rank), "node": socket.gethostname(), "step_s": round(step_s, 6),
                "comm_s": round(comm_s, 6), "compute_s": round(max(step_s - comm_s, 0.0), 6),
                "calls": round(self.calls / self.steps, 1)}

    def gather(self, engine):
        try:
            mine = self.figures(engine)
        except Exception as e:  # noqa: BLE001 - a measurement, never a rank's failure: said, and gathered
            mine = {"rank": int(engine.global_rank), "node": socket.gethostname(), "error": f"{type(e).__name__}: {e}"}
        dist = sys.modules["torch"].distributed
        ranks = [None] * dist.get_world_size()
        began = time.perf_counter()
        dist.all_gather_object(ranks, mine)  # waits for the slowest rank too: comm time of the next window
        self.steps, self.step_s, self.spans, self.calls = 0, 0.0, [], 0
        self.gathered_s = time.perf_counter() - began
        if engine.global_rank == 0:
            line = {"time": round(time.time(), 3), "step": int(engine.global_steps), "window": self.window,
                    "ranks": ranks}
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(line) + "\n")
            except OSError as e:
                print(f"[dsc_node] the ranks' times at step {line['step']} are not kept: {e}", file=sys.stderr)


class TimedHandle:
    """An asynchronous collective's handle (torch.distributed.Work) as its caller gets it: its first
    wait() ends the collective's span (RankTimes); everything else is the handle's own."""

    def __init__(self, handle, times, start):
        self._handle, self._times, self._start = handle, times, start

    def wait(self, *args, **kwargs):
        out = self._handle.wait(*args, **kwargs)
        if self._start is not None:
            self._times.span_end(self._start)
            self._start = None
        return out

    def __getattr__(self, name):
        return getattr(self._handle, name)

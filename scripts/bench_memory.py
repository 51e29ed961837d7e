"""Where a CPU `ppo-train` run's resident memory goes, phase by phase.

    python scripts/bench_memory.py +experiment=gsm8k_cpu trainer.total_steps=2 data.arithmetic.val_size=16

Runs `ppo-train` in this process with the given overrides (with `devices.backend=local`, the CPU
recipes' default, every role lives in it; Ray's workers would not be counted) and prints, for the
build, each validation and every timed phase of every step: seconds, the resident set (VmRSS)
before, at its peak and after, and where the C library is glibc, the heap's bytes in use at their
peak and the heap's size after the phase. Heap size less peak use is memory the allocator holds
that the run never needed at once: free blocks between live ones, which CPU workers keep for reuse
(`workers.process_tuning.keep_freed_host_memory`) instead of handing them back. A thread samples
every --interval seconds, so a spike shorter than that can be missed. The table also goes to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from ppo_trainer.console import console_stream

GIB = 2**30


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (<malloc.h>, glibc >= 2.33), every field a size_t."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Optional[Callable[[], MallInfo2]]:
    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is None:
        return None
    function.restype = MallInfo2
    return function


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


class Peaks:
    """The highest resident set and heap use a `Sampler` saw while this span was open."""

    def __init__(self) -> None:
        self.rss = self.heap_in_use = 0


class Sampler:
    """A daemon thread that raises the `Peaks` of every open span (spans nest: a step holds its phases)."""

    def __init__(self, interval: float) -> None:
        self.mallinfo = _mallinfo2()
        self.open: list[Peaks] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._run, args=(interval,), daemon=True).start()

    def heap(self) -> Optional[tuple[int, int]]:
        """(bytes in use, heap size: main-arena and thread-arena memory plus mmapped blocks), or None."""
        if self.mallinfo is None:
            return None
        info = self.mallinfo()
        return info.uordblks + info.hblkhd, info.arena + info.hblkhd

    def sample(self) -> None:
        if not self.open:  # mallinfo2 takes the allocator's lock: no reads that no span wants
            return
        rss, heap = resident_bytes(), self.heap()
        with self.lock:
            for peaks in self.open:
                peaks.rss = max(peaks.rss, rss)
                if heap is not None:
                    peaks.heap_in_use = max(peaks.heap_in_use, heap[0])

    @contextmanager
    def watch(self) -> Iterator[Peaks]:
        peaks = Peaks()
        with self.lock:
            self.open.append(peaks)
        self.sample()
        try:
            yield peaks
        finally:
            self.sample()
            with self.lock:
                self.open.remove(peaks)

    def _run(self, interval: float) -> None:
        while True:
            self.sample()
            time.sleep(interval)


class Report:
    """One table row per measured span, printed as it ends and kept for --out."""

    HEADER = (f"{'step':>4s} {'phase':14s} {'seconds':>8s} {'rss before':>10s} {'rss peak':>9s} {'rss after':>9s}"
              f" {'heap used':>9s} {'heap size':>9s}   (GiB)")

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.lines = [self.HEADER]
        self.step = 0

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        before, start = resident_bytes(), time.perf_counter()
        with self.sampler.watch() as peaks:
            yield
        seconds, heap = time.perf_counter() - start, self.sampler.heap()
        used, size = ((f"{peaks.heap_in_use / GIB:9.2f}", f"{heap[1] / GIB:9.2f}") if heap
                      else (f"{'-':>9s}", f"{'-':>9s}"))
        line = (f"{self.step:4d} {phase:14s} {seconds:8.2f} {before / GIB:10.2f}"
                f" {peaks.rss / GIB:9.2f} {resident_bytes() / GIB:9.2f} {used} {size}")
        self.lines.append(line)
        print(line, file=console_stream(), flush=True)  # the terminal, also while the engines' output goes to engine.log


def instrument(report: Report) -> None:
    """Measure the trainer's build, validations and timed phases (its `_Timer` spans)."""
    from ppo_trainer import trainer

    class MeasuredTimer(trainer._Timer):
        @contextmanager
        def __call__(self, phase: str) -> Iterator[None]:
            with report.span(phase), super().__call__(phase):
                yield

    def measured(name: str, method: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with report.span(name):
                return method(*args, **kwargs)
        return wrapper

    train_step = trainer.Trainer.train_step

    def counted_train_step(self, step: int):
        report.step = step
        return train_step(self, step)

    trainer._Timer = MeasuredTimer
    trainer.Trainer.from_config = classmethod(measured("build", trainer.Trainer.from_config.__func__))
    trainer.Trainer.validate = measured("validate", trainer.Trainer.validate)
    trainer.Trainer.train_step = counted_train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args, overrides = parser.parse_known_args()
    if args.interval <= 0:
        parser.error(f"--interval must be positive seconds, got {args.interval}")
    report = Report(Sampler(args.interval))
    instrument(report)
    print(Report.HEADER, flush=True)

    from ppo_trainer.cli import train_main

    sys.argv = ["ppo-train", *overrides]
    code = 0
    try:
        train_main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    if len(report.lines) > 1:  # the run got as far as building the roles
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report.lines.append(f"peak resident set (ru_maxrss): {peak / GIB:.2f} GiB ({peak // 1024:,} kB)")
        print("\n".join(report.lines))
        if args.out is not None:
            args.out.write_text("\n".join(report.lines) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()

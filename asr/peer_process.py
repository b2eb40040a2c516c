"""faster-whisper in a process of its own, for `asr evaluate --peers faster-whisper`.

In ours, once CTranslate2 (with its own OpenMP runtime) had decoded a file, our decoding
ran slower from then on, in wall time for the same CPU time, and faster-whisper ran slower
too (`asr evaluate` on the English dev set: our target-only decoder 6.57 s against 3.96 s,
faster-whisper 18.7 s against 14.1 s). Only the standard library is imported
here, so the worker process starts light. It is started with the caller's `sys.path` (so it
runs this very package), not as a multiprocessing child, which would import the caller's
main script again."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection

# Run in the worker: the caller's import path (argv[2]), then this module as __main__ (argv[1]: the socket).
_START = "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[2]); runpy.run_module('asr.peer_process', run_name='__main__')"


def _serve(connection: Connection) -> None:
    """The worker: reads (settings, seed), makes the model, answers (True, None) or (False, why),
    then transcribes each request (faster-whisper's transcribe arguments) until the
    connection closes, answering (True, (segments as (text, tokens, start, end), seconds)) or
    (False, why)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it closes the connection
    try:
        settings, seed = connection.recv()
        import ctranslate2
        from faster_whisper import WhisperModel

        model = WhisperModel(**settings)
        # CTranslate2 seeds a thread's generator once, at its first sample: set before any.
        ctranslate2.set_random_seed(seed)
    except Exception as error:
        connection.send((False, f"{type(error).__name__}: {error}"))
        return
    connection.send((True, None))
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        try:
            started = time.perf_counter()
            segments = list(model.transcribe(**request)[0])  # the generator does the work
            seconds = time.perf_counter() - started
            answer = (True, ([(s.text, s.tokens, s.start, s.end) for s in segments], seconds))
        except Exception as error:
            answer = (False, f"{type(error).__name__}: {error}")
        try:
            connection.send(answer)
        except OSError:  # the caller has gone (Ctrl-C closed the connection): two tracebacks said so
            return


class FasterWhisperProcess:
    """A faster-whisper WhisperModel(**settings) in a child process, seeded with `seed`. A model
    not loaded within `load_timeout` seconds (a hung read: a stalled network drive) fails as
    one that cannot load, rather than holding the caller for ever; every later start then
    fails at once, rather than after the limit each time."""

    def __init__(self, settings: dict, seed: int, load_timeout: float = 600):
        self._settings, self._seed, self._load_timeout = settings, seed, load_timeout
        self._hung: str | None = None  # why a load timed out: later starts fail at once, not each after the limit
        self._start()

    def _start(self) -> None:
        if self._hung is not None:
            raise RuntimeError(self._hung)
        ours, theirs = socket.socketpair()
        try:
            # -I: neither the working directory nor PYTHONPATH ahead of the caller's path.
            self._process = subprocess.Popen([sys.executable, "-I", "-c", _START, str(theirs.fileno()), json.dumps(sys.path)],
                                             pass_fds=[theirs.fileno()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())
        self._ended: str | None = None  # why the process ended, once it has
        self._stopped = False  # ended (killed for taking too long, or crashed): the next request starts another
        try:
            with self._watch(self._load_timeout, "its model did not load", loading=True):
                self._connection.send((self._settings, self._seed))
                self._answer()  # a model that cannot load fails here, not at the first file
        except Exception:
            self._stopped = True  # the next request tries again (a later file failed as "process ended")
            self.close()
            raise

    def transcribe(self, timeout: float | None = None, **arguments) -> tuple[list[tuple[str, list[int], float, float]], float]:
        """faster-whisper's transcribe(**arguments): its segments as (text, tokens, start, end), and its
        seconds. With no answer within `timeout` seconds the process is killed (by a timer: sending
        the audio blocks too once the process stops reading) and this raises; the next call starts
        another, loading the model again."""
        if self._stopped:
            self.close(wait=0)
            self._start()
        with self._watch(timeout, "no answer"):
            try:
                self._connection.send(arguments)
            except OSError:
                self._died()
            return self._answer()

    @contextmanager
    def _watch(self, timeout: float | None, what: str, loading: bool = False):
        """Kills the process if the block has not ended within `timeout` seconds (by a timer:
        sending the audio blocks too once the process stops reading)."""
        if timeout is None:
            yield
            return
        why = f"faster-whisper: {what} within {timeout:.0f} s (its process was stopped)"
        watchdog = threading.Timer(timeout, self._stop, (self._process, why, loading))  # this process, not a later one
        watchdog.start()
        try:
            yield
        finally:
            watchdog.cancel()

    def _stop(self, process: subprocess.Popen, why: str, loading: bool) -> None:
        if process is not self._process:  # the block ended and another process started meanwhile
            return
        self._ended = why
        if loading:
            self._hung = why
        self._stopped = True
        process.kill()  # our send or receive then fails, and raises _ended

    def _answer(self):
        try:
            ok, value = self._connection.recv()
        except (EOFError, OSError):
            self._died()
        if not ok:
            raise RuntimeError(f"faster-whisper: {value}")
        return value

    def _died(self) -> None:
        if self._ended is None:
            try:
                status = self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            self._ended = f"faster-whisper's process ended (exit status {status})"
        self._stopped = True  # a crash (a segfault, out of memory) is this file's: the next starts another
        raise RuntimeError(self._ended)

    def close(self, wait: float = 10) -> None:
        """Ends the process: at once (wait 0), or after `wait` seconds for it to end by itself."""
        self._connection.close()  # the worker's recv() then ends it
        try:
            self._process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))

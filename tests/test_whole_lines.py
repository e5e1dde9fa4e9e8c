"""Output of a Ray driver stays in whole lines (logs.WholeLines): what cut CI's serve banner in two."""

from __future__ import annotations

import io
import sys
import threading

from splitserve.logs import WholeLines, keep_output_lines_whole

RAY_LINE = "(WorkerActor pid=3743) INFO splitserve.kvtransfer.receiver: KV receiver listening (backend grpc)"
BANNER = "splitserve: serving 'demo' on http://127.0.0.1:8000/v1 (1 prefill + 1 decode workers)"


def ray_prints_around(stream, between) -> None:
    """Ray's forwarder: a line's text, then (after `between` ran in another thread) its newline."""
    text_written, other_done = threading.Event(), threading.Event()

    def forwarder():
        stream.write(RAY_LINE)  # print() writes the text and the newline separately
        text_written.set()
        other_done.wait(5)
        stream.write("\n")

    thread = threading.Thread(target=forwarder)
    thread.start()
    text_written.wait(5)
    between()
    other_done.set()
    thread.join(5)


def test_a_line_printed_while_ray_is_between_text_and_newline_stays_whole():
    raw = io.StringIO()
    out = WholeLines(raw)
    ray_prints_around(out, lambda: print(BANNER, file=out, flush=True))
    assert raw.getvalue().splitlines() == [BANNER, RAY_LINE]


def test_without_it_the_lines_are_cut_as_ci_saw():  # the failure the wrapper exists for
    raw = io.StringIO()
    ray_prints_around(raw, lambda: print(BANNER, file=raw, flush=True))
    assert raw.getvalue().splitlines() == [RAY_LINE + BANNER, ""]


def test_a_flush_passes_on_a_partial_line_and_the_rest_is_the_streams_own():
    raw = io.StringIO()
    out = WholeLines(raw)
    out.write("loading 40%")
    assert raw.getvalue() == ""
    out.flush()  # progress bars flush what they have
    assert raw.getvalue() == "loading 40%"
    out.writelines(["\rloading 100%", "\n", "done\nand"])
    assert raw.getvalue() == "loading 40%\rloading 100%\ndone\n"
    assert out.getvalue() == raw.getvalue()  # not ours: the stream's own attribute


def test_installing_it_twice_wraps_once(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    keep_output_lines_whole()
    keep_output_lines_whole()
    assert isinstance(sys.stdout, WholeLines) and not isinstance(sys.stdout._stream, WholeLines)
    assert isinstance(sys.stderr, WholeLines) and not isinstance(sys.stderr._stream, WholeLines)

"""Progress of long-running commands: drawn on a terminal (a pseudo-terminal here, read
as bytes), nothing at all when standard error is a file or a pipe."""

from __future__ import annotations

import io
import json
import os
import pty
from collections.abc import Callable, Iterator

import pytest
from django.core.management import call_command

from sageproject.progress import Progress, note
from scheduling.models import Session
from tests.scheduling.test_export_import import _events, _session


class Terminal:
    """A pseudo-terminal: ``stream`` is its text end (a tty), ``read()`` what reached the
    screen (all of it, once the writer's end is closed)."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        self.stream = os.fdopen(slave, "w", encoding="utf-8")

    def read(self) -> bytes:
        self.stream.close()
        chunks = []
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the other end is closed and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self.master)
        return b"".join(chunks)


@pytest.fixture
def terminal() -> Iterator[Callable[[], Terminal]]:
    opened: list[Terminal] = []

    def open_one() -> Terminal:
        opened.append(Terminal())
        return opened[-1]

    yield open_one
    for t in opened:
        if not t.stream.closed:
            t.stream.close()
            os.close(t.master)


def test_it_redraws_one_line_on_a_terminal(terminal):
    screen = terminal()
    with Progress("copying", total=4, stream=screen.stream, min_interval=0) as bar:
        for _ in range(4):
            bar.advance()
    assert screen.read() == (
        b"\rcopying 0 / 4 (0%)\x1b[K"
        b"\rcopying 1 / 4 (25%)\x1b[K"
        b"\rcopying 2 / 4 (50%)\x1b[K"
        b"\rcopying 3 / 4 (75%)\x1b[K"
        b"\rcopying 4 / 4 (100%)\x1b[K"
        b"\rcopying 4 / 4 (100%)\x1b[K\r\n"  # the last figure again, and the line ends
    )


def test_it_draws_at_most_every_interval_but_always_the_last_figure(terminal):
    screen = terminal()
    now = [0.0]
    with Progress(
        "reading", total=3 << 20, unit="B", stream=screen.stream, clock=lambda: now[0]
    ) as bar:
        bar.update(1 << 20)  # within the interval of the first draw: skipped
        now[0] = 0.5
        bar.update(2 << 20)
        bar.update(3 << 20)  # skipped again, drawn by close
    assert screen.read() == (
        b"\rreading 0 B / 3.0 MiB (0%)\x1b[K"
        b"\rreading 2.0 MiB / 3.0 MiB (67%)\x1b[K"
        b"\rreading 3.0 MiB / 3.0 MiB (100%)\x1b[K\r\n"
    )


def test_it_prints_nothing_to_a_file_or_a_pipe():
    buffer = io.StringIO()
    with Progress("quiet", total=2, stream=buffer, min_interval=0) as bar:
        bar.advance(2)
    note("a phase", stream=buffer, prefix="bench")
    assert buffer.getvalue() == ""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        note("a phase", stream=pipe)
        with Progress("quiet", stream=pipe) as bar:
            bar.advance()
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b""


def test_a_note_is_one_line_on_a_terminal(terminal):
    screen = terminal()
    note("seeding 100 events", stream=screen.stream, prefix="bench_persist")
    assert screen.read() == b"bench_persist: seeding 100 events\r\n"


@pytest.fixture
def export_file(alice, tmp_path):
    """An exported session of three events; the session itself is removed again."""
    session = _session(alice)
    _events(session, [{"n": 1}, {"n": 2}, {"n": 3}])
    path = tmp_path / "session.jsonl"
    call_command("export_session", str(session.pk), output=str(path))
    Session.objects.filter(pk=session.pk).delete()
    return session.pk, path


@pytest.mark.django_db
def test_import_and_export_show_progress_on_a_terminal_only(export_file, terminal, tmp_path):
    session_id, path = export_file
    size = path.stat().st_size
    screen = terminal()
    out = io.StringIO()
    call_command("import_session", str(path), stdout=out, stderr=screen.stream)
    drawn = screen.read()
    assert drawn.startswith(b"\rimport_session 0 B / ")
    assert drawn.endswith(f"import_session {size} B / {size} B (100%)\x1b[K\r\n".encode())
    assert out.getvalue() == f"imported session {session_id} (3 events)\n"

    screen = terminal()
    again = tmp_path / "again.jsonl"
    call_command("export_session", str(session_id), output=str(again), stderr=screen.stream)
    assert screen.read().endswith(b"\rexport_session 4 lines\x1b[K\r\n")  # header + 3 events
    assert again.read_bytes() == path.read_bytes()

    quiet = io.StringIO()
    call_command("export_session", str(session_id), output=str(again), stderr=quiet)
    assert quiet.getvalue() == ""


@pytest.mark.django_db
def test_release_idle_shows_its_wait_on_a_terminal(terminal):
    screen = terminal()
    out = io.StringIO()
    with pytest.raises(SystemExit):
        call_command("release_idle", "--wait", "0", "--json", stdout=out, stderr=screen.stream)
    drawn = screen.read()
    assert drawn.startswith(b"\rrelease_idle: waiting for a worker to answer #")
    assert drawn.endswith(b"\x1b[K\r\n")
    assert json.loads(out.getvalue())["error"]["code"] == "management.no_worker"


def test_a_benchmark_keeps_its_json_lines_and_notes_its_phases_on_a_terminal(terminal):
    screen = terminal()
    out = io.StringIO()
    call_command(
        "bench_session_projection", "--events", "20", "--repeats", "1",
        stdout=out, stderr=screen.stream,
    )  # fmt: skip
    assert screen.read() == b"bench_session_projection: building 20 events\r\n"
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["events"] == 20

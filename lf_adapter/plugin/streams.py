"""The trainer's stdout and stderr go to the attempt log in the run folder. When that disk fills, a print or a
progress bar raises OSError(ENOSPC) inside the training loop and kills a run that could have saved; wrapped, the
output is dropped instead (the log says so once space returns) and training reaches its next save, where a full
output disk is a real, classified failure (disk_full)."""

from __future__ import annotations

import errno
import sys


class DiskFullTolerantStream:
    """A text stream whose write and flush drop output on ENOSPC instead of raising."""

    def __init__(self, stream):
        self._stream, self.dropped = stream, 0

    def write(self, text):
        try:
            written = self._stream.write(text)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            self.dropped += 1
            return len(text)
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            self.write(f"\nlfa: {dropped} writes to this log were lost: its disk was full\n")
        return written

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            self.dropped += 1

    def __getattr__(self, name):  # fileno, isatty, encoding... as the wrapped stream has them
        return getattr(self._stream, name)


def tolerate_full_disk() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, DiskFullTolerantStream):
            setattr(sys, name, DiskFullTolerantStream(stream))

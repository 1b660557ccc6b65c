"""Run a build command (``pip install -v ...``) and show its progress in a few lines.

``make`` installs graphctl with ``pip install -q``, which showed nothing for the minutes the
extension compiles: a newcomer could not tell a build from a hang. This wrapper runs the command
verbosely, prints graphctl's own build lines (``graphctl build: ...``) and one line per compiled
source (ninja's ``[i/n]`` steps) with the time so far, says it is still working when a step takes
long, and on a failure prints the command's last lines. Its exit code is the command's.

    python scripts/build-progress.py pip install -v --no-build-isolation -e '.[dev]'
"""
from __future__ import annotations

import collections
import queue
import re
import subprocess
import sys
import threading
import time

_STEP = re.compile(r"^\[(\d+)/(\d+)\]\s.*?(\S+\.(?:cpp|cu|c))\b")
_HEARTBEAT_S = 20.0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=80)
    last_said = time.monotonic()
    seen: set[str] = set()  # pip runs setup.py twice (requirements, then the build): say each line once
    while True:
        try:
            line = lines.get(timeout=_HEARTBEAT_S)
        except queue.Empty:
            print(f"  ... still building ({time.monotonic() - t0:.0f} s)", flush=True)
            last_said = time.monotonic()
            continue
        if line is None:
            break
        tail.append(line)
        said = None
        m = _STEP.match(line.strip())
        if m:
            said = f"  compiling {m.group(1)}/{m.group(2)}: {m.group(3).split('/csrc/')[-1]}"
        elif "graphctl build:" in line and line.strip() not in seen:
            seen.add(line.strip())
            said = "  " + line.strip()[line.strip().index("graphctl build:"):]
        elif line.startswith("Successfully installed"):
            said = "  installed"
        if said is not None:
            print(f"{said} ({time.monotonic() - t0:.0f} s)", flush=True)
            last_said = time.monotonic()
        elif time.monotonic() - last_said > _HEARTBEAT_S:
            print(f"  ... still building ({time.monotonic() - t0:.0f} s)", flush=True)
            last_said = time.monotonic()
    rc = proc.wait()
    if rc != 0:
        print(f"the build failed (exit {rc}); its last lines:", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
    else:
        print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

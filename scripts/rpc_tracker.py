#!/usr/bin/env python
"""Start a TVM RPC tracker (``python -m tvm.exec.rpc_tracker``) for ``tvm-fusion tune``.

    python scripts/rpc_tracker.py --host 0.0.0.0 --port 9190

Servers and phones register with it under a key (``scripts/rpc_server.py --key android``, or
the TVM RPC app / ``tvm_rpc`` on the phone, see docs/android.md); ``tvm-fusion tune --tracker
HOST:9190 --key android`` asks it for sessions. It runs in the foreground until Ctrl-C or
SIGTERM, then stops the tracker and its worker children by process id. Query it with
``python -m tvm.exec.query_rpc_tracker --host HOST --port 9190``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvm_fusion.tuning import rpc  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0",
                        help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=9190, help="port (exactly this one)")
    parser.add_argument("--pid-file", help="write the tracker's process id here")
    args = parser.parse_args(argv)
    probe = "127.0.0.1" if args.host == "0.0.0.0" else args.host
    try:
        proc, port = rpc.start_tracker(args.host, args.port, log=sys.stdout,
                                       probe_host=probe)
    except (RuntimeError, TimeoutError) as err:
        print(f"rpc_tracker: {err} (is port {args.port} in use?)", file=sys.stderr)
        return 2
    if args.pid_file:
        with open(args.pid_file, "w", encoding="utf-8") as handle:
            handle.write(f"{proc.pid}\n")
    print(f"rpc_tracker: listening on {args.host}:{port} (pid {proc.pid}); query: python -m "
          f"tvm.exec.query_rpc_tracker --host {probe} --port {port}", flush=True)
    return rpc.serve_until_signal(proc)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())

#!/usr/bin/env python
"""Start a TVM RPC server (``python -m tvm.exec.rpc_server``) registered under a key.

    python scripts/rpc_server.py --tracker 127.0.0.1:9190 --key android

This is the Python server, for this machine or a Linux board with Python and TVM (it links
the tar of objects each candidate arrives as with the local compiler). A phone runs the C++
``tvm_rpc`` server or the TVM RPC app instead (docs/android.md). Several servers under one key
share the trials of ``tvm-fusion tune --key KEY``. Runs in the foreground until Ctrl-C or
SIGTERM, then stops the server and its ``popen_worker`` child by process id (killing only the
parent leaves an orphan that keeps the port and registers again).
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
    parser.add_argument("--tracker", required=True, metavar="HOST:PORT",
                        help="the tracker to register with")
    parser.add_argument("--key", default="android", help="device key (default: android)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on, reachable from the tuning machine")
    parser.add_argument("--port", type=int, default=None,
                        help="port (default: a free one)")
    parser.add_argument("--pid-file", help="write the server's process id here")
    args = parser.parse_args(argv)
    try:
        rpc.parse_tracker(args.tracker)
        proc, port = rpc.start_server(args.tracker, args.key, args.host, args.port,
                                      log=sys.stdout)
    except ValueError as err:
        print(f"rpc_server: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as err:
        print(f"rpc_server: {err}", file=sys.stderr)
        return 1
    if args.pid_file:
        with open(args.pid_file, "w", encoding="utf-8") as handle:
            handle.write(f"{proc.pid}\n")
    print(f"rpc_server: key {args.key!r} on {args.host}:{port} (pid {proc.pid}), registered "
          f"at {args.tracker}", flush=True)
    return rpc.serve_until_signal(proc)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())

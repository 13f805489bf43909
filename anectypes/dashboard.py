"""python -m anectypes.dashboard — the web dashboard: start, watch, stop and resume training runs.

    python -m anectypes.dashboard                          # http://127.0.0.1:8000/, runs under ./runs
    python -m anectypes.dashboard --port 8080 --runs-dir runs --data-dir data --token SECRET

Binding anything but a loopback address needs a token (--token, or env ANECTYPES_TOKEN); one is
generated and printed when none is given. Open the printed URL: its `?token=` sets a cookie once.
Stopping the dashboard (Ctrl-C) also stops the runs it launched, each with a checkpoint.
"""

import argparse
import os
import secrets
import socket
import sys

import uvicorn

from anectypes.cli import ArgumentParser


class Server(uvicorn.Server):
    """uvicorn.run's server, which also tells open event streams to end as soon as Ctrl-C/SIGTERM arrives
    (uvicorn waits for open responses before it shuts the app down)."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame):
        self.on_exit()
        super().handle_exit(sig, frame)


def bounded(lo, hi=None):
    """An argparse type: an integer in [lo, hi]."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, not {text!r}") from None
        if n < lo or hi is not None and n > hi:
            raise argparse.ArgumentTypeError(f"must be {lo}-{hi}, not {n}" if hi else f"must be >= {lo}, not {n}")
        return n
    return parse


def parse_args(argv):
    ap = ArgumentParser(prog="python -m anectypes.dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=bounded(1, 65535), default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--runs-dir", default="runs", help="folder of run directories (default: runs)")
    ap.add_argument("--data-dir", default="data", help="the folder a run's data and tokenizer files must be in "
                                                       "(default: data, in the current folder)")
    ap.add_argument("--token", help="require this bearer token (default: env ANECTYPES_TOKEN; generated "
                                    "when binding a non-loopback address)")
    ap.add_argument("--max-running", type=bounded(0), default=1,
                    help="runs allowed at the same time (default 1; 0: runs only wait in the queue)")
    return ap.parse_args(argv)


def listen(host, port):
    """A socket bound to host:port (uvicorn serves it), so that an address in use or not bindable is
    one error line before the URL is printed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from anectypes.web.app import create_app
    from anectypes.web.security import is_loopback

    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        print(f"error: --data-dir {args.data_dir}: not a folder", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host} port {args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    token = args.token or os.environ.get("ANECTYPES_TOKEN") or None
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(24)
        print(f"warning: binding {args.host} exposes the dashboard beyond this machine; generated a token "
              f"(pass --token to choose one): {token}", file=sys.stderr, flush=True)
    try:
        app = create_app(args.runs_dir, token=token, host=args.host, port=args.port, max_running=args.max_running,
                         data_dir=args.data_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --runs-dir {args.runs_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    shown = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
    shown = f"[{shown}]" if ":" in shown else shown
    url = f"http://{shown}:{args.port}/" + (f"?token={token}" if token else "")
    print(f"anectypes dashboard: {url}  (runs in {args.runs_dir}; Ctrl-C stops it and its runs)", flush=True)
    # uvicorn.run(app, host, port, timeout_graceful_shutdown=2, log_level="warning"), plus the early stream end
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=2, log_level="warning")
    Server(config, on_exit=app.state.store.begin_shutdown).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`anelm serve`: an OpenAI-compatible server for one model (docs/serving.md).

    anelm serve --model smollm2.gguf                      # http://127.0.0.1:8080/v1
    anelm serve --model RUN --adapter RUN/best --port 9000 --api-key secret

Every program of the served context is built before the server answers (the compile budget
holds them, `device_plan`), so no request waits for a compile; a second start loads them from
the program store. Requests run one at a time on the device, in arrival order.
"""

from __future__ import annotations

import argparse
import sys

from .common import add_adapter_arg, add_device_args, check_before_loading, positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="an HF folder, a RUN folder, a llama2.c .bin or a .gguf file")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer file or folder (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                   help="positions a conversation may hold (default: the model's context, at most 4096 on "
                        "the device); fewer builds fewer, smaller programs")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model's name in the API (default: the model file's or folder's name)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY'")
    add_adapter_arg(p)
    add_device_args(p)


def run(args: argparse.Namespace) -> int:
    from ..generate.engine import load_engine, notice
    from ..serve.server import make_server
    from ..serve.worker import DeviceWorker

    if not 0 <= args.port <= 65535:
        from ..errors import UsageError

        raise UsageError(f"--port {args.port}: expected a port in [0, 65535]")
    check_before_loading(args)
    engine = load_engine(args.model, tokenizer=args.tokenizer, adapter=args.adapter, device=args.device,
                         profile=args.profile, max_context=args.max_context, model_id=args.model_id)
    warm = getattr(engine.runner, "warm", None)
    if warm is not None:
        from tqdm import tqdm

        with tqdm(desc="programs", unit="prog", file=sys.stderr, disable=None) as bar:
            built = warm(lambda: bar.update(1))
        notice(f"{built} programs ready for contexts up to {engine.context} tokens")
    server = make_server(DeviceWorker(engine), engine.model_id, args.host, args.port, args.api_key)
    host, port = server.server_address[:2]
    notice(f"serving {engine.model_id} on http://{host}:{port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        notice("stopped")
    finally:
        server.server_close()
    return 0

"""The thinnest gRPC server that streams llama.cpp's own ``Llama.generate``: a thread runs
it and each token goes out as one ``GenerateStreamResponse`` through grpc.aio, with no
engine, scheduler or stream layers. ``bench.default_server`` times it beside the default
server: its ratio to ``Llama.generate`` is the ceiling of any Python gRPC server that sends
a message a token on the same cores as the bench's client (2026-11-29, 2-core AVX2: 0.94x,
where the default server read 0.88x). Greedy, one request at a time, for the bench only.

``python -m bench.thin_server --gguf FILE --port N [--threads T]``
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import grpc

from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc


class ThinStreamer(pb_grpc.GenerationServiceServicer):
    def __init__(self, llm) -> None:
        self.llm = llm

    def _generate(self, request: pb.GenerateRequest, put: Callable[[int | None], None]) -> None:
        """On its own thread, as an engine thread would: each token handed to the loop."""
        llm = self.llm
        ids = llm.tokenize(request.prompt.encode())
        left = request.stopping.max_new_tokens or 16
        llm.reset()
        for token in llm.generate(ids, temp=0.0, reset=True):
            put(token)
            left -= 1
            if left == 0:
                break
        put(None)

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        threading.Thread(target=self._generate, daemon=True, args=(
            request.request, lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t))).start()
        while (token := await tokens.get()) is not None:
            text = self.llm.detokenize([token]).decode(errors="replace")
            yield pb.GenerateStreamResponse(index=0, text=text, token_ids=[token])


async def serve(gguf: str, port: int, threads: int) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=False)  # as bench.default_server's baseline
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(ThinStreamer(llm), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    asyncio.run(serve(args.gguf, args.port, args.threads))


if __name__ == "__main__":
    main()

"""A proxy in front of a ``/generate`` server that alters one output id of one reply (test-only): the trial that a
test comparing stored rows with another server's would notice a single changed id.

Every request is forwarded unchanged; the first ``/generate`` reply whose ``output_ids`` has two or more ids gets its
first id replaced by the next id (mod 2), so the reply stays well-formed in length and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import aiohttp
from aiohttp import web


@contextlib.contextmanager
def altering_proxy(upstream: str) -> Iterator[str]:
    """Run the proxy on a free loopback port for the block; yields its URL."""
    state = {"altered": False}
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with aiohttp.ClientSession() as session:
            async with session.request(request.method, upstream + request.path_qs, data=body,
                                       headers={"Content-Type": request.headers.get("Content-Type",
                                                                                     "application/json")}) as resp:
                data = await resp.read()
                status = resp.status
        if request.path == "/generate" and status == 200 and not state["altered"]:
            reply = json.loads(data)
            ids = reply.get("output_ids") or []
            if len(ids) >= 2:
                ids[0] = ids[0] ^ 1
                state["altered"] = True
                data = json.dumps(reply).encode()
        return web.Response(body=data, status=status, content_type="application/json")

    async def serve() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

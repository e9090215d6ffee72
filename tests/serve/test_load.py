"""Load on loopback: 32 concurrent streaming clients, 256 requests in all, against one server. No errors,
every greedy answer equal to that prompt's answer when it ran alone, and the KV pool back to full."""

from __future__ import annotations

import asyncio
import time

import openai

from tests.serve.test_api import MODEL, Server

CLIENTS, REQUESTS, MAX_TOKENS = 32, 256, 24
PROMPTS = [f"Question {i}: what does a {word} eat?" for i, word in
           enumerate(["hawk", "falcon", "owl", "kestrel", "eagle", "kite", "harrier", "osprey"] * 2)]


async def stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
    return "".join([c.choices[0].text async for c in chunks])


def test_concurrent_streaming_clients():
    # 32 requests of ~12 + 24 tokens (+ the tree's reserve) need ~96 blocks of 16: 48 also exercises preemption (a
    # request admitted with a block to spare may still grow by two).
    with Server(num_blocks=48) as server:
        alone = {}
        with server.client() as client:
            for p in PROMPTS:
                alone[p] = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                                     temperature=0).choices[0].text

        async def run() -> list[tuple[str, str]]:
            todo = asyncio.Queue()
            for i in range(REQUESTS):
                todo.put_nowait(PROMPTS[i % len(PROMPTS)])
            results = []
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                          timeout=60) as client:

                async def worker():  # one client: takes prompts until none are left
                    while not todo.empty():
                        prompt = todo.get_nowait()
                        results.append((prompt, await stream_text(client, prompt)))

                await asyncio.gather(*(worker() for _ in range(CLIENTS)))
            return results

        started = time.perf_counter()
        results = asyncio.run(run())
        seconds = time.perf_counter() - started
        assert len(results) == REQUESTS
        assert [p for p, text in results if text != alone[p]] == []
        server.wait_idle()
        assert server.metric("eyas_kv_blocks_free") == server.num_blocks
        assert server.metric("eyas_http_requests_total", endpoint="/v1/completions", status="200") == \
            REQUESTS + len(PROMPTS)
        assert server.metric("eyas_requests_finished_total", reason="error") == 0
        engine = server.worker.engine
        assert server.metric("eyas_preemptions_total") == engine.preemptions > 0
        assert server.metric("eyas_recomputed_positions_total") == engine.recomputed > 0
        print(f"{REQUESTS} streamed requests from {CLIENTS} clients in {seconds:.1f}s")

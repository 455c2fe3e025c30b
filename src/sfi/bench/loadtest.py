"""Load test of a running ``sfi serve``: N concurrent streaming clients for a bounded time.

Each client sends streaming ``/v1/completions`` requests (essay slices as prompts, of one or
several lengths) one after another until the time is up; the report gives requests/s, tokens/s,
time to first token and inter-token latency (p50/p99/max), the *join stall* (the longest gap
between two tokens of a running stream while another request was waiting for its first token,
i.e. joining), errors, and the server's peak memory from ``/metrics``.
Traffic goes only to the given URL, which should be a loopback address.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class ClientLog:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    gap_spans: list[tuple[float, float]] = field(default_factory=list)  # (previous, this token)
    joins: list[tuple[float, float]] = field(default_factory=list)  # (sent, first token)
    error_messages: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _client(http: httpx.AsyncClient, url: str, prompts: list[str], index: int,
                  deadline: float, body: dict[str, Any], log: ClientLog) -> None:
    n = 0
    while time.perf_counter() < deadline:
        prompt = prompts[(index + n * 7) % len(prompts)]
        n += 1
        start = time.perf_counter()
        last = None
        try:
            async with http.stream("POST", f"{url}/v1/completions",
                                   json={**body, "prompt": prompt, "stream": True}) as r:
                if r.status_code != 200:
                    log.errors += 1
                    log.error_messages.append(f"HTTP {r.status_code}")
                    await r.aread()
                    await asyncio.sleep(0.2)
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    if chunk["choices"][0]["text"]:
                        now = time.perf_counter()
                        if last is None:
                            log.ttft.append(now - start)
                            log.joins.append((start, now))
                        else:
                            log.gaps.append(now - last)
                            log.gap_spans.append((last, now))
                        last = now
                    if chunk.get("usage"):
                        log.tokens += chunk["usage"]["completion_tokens"]
            log.requests += 1
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            log.errors += 1
            log.error_messages.append(str(exc)[:200])


def join_stall(gap_spans: list[tuple[float, float]], joins: list[tuple[float, float]]) -> float:
    """The longest inter-token gap that overlaps some request's wait for its first token."""
    worst = 0.0
    for a, b in gap_spans:
        if b - a > worst and any(s < b and f > a for s, f in joins):
            worst = b - a
    return worst


async def _run(url: str, clients: int, duration: float, body: dict[str, Any],
               prompts: list[list[str]], headers: dict[str, str]) -> dict[str, Any]:
    logs = [ClientLog() for _ in range(clients)]
    timeout = httpx.Timeout(duration + 120)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        start = time.perf_counter()
        deadline = start + duration
        await asyncio.gather(*(_client(http, url, prompts[i % len(prompts)], i, deadline,
                                       body, logs[i]) for i in range(clients)))
        elapsed = time.perf_counter() - start
        metrics = (await http.get(f"{url}/metrics")).text
    ttft = [t for log in logs for t in log.ttft]
    gaps = [g for log in logs for g in log.gaps]
    stall = join_stall([s for log in logs for s in log.gap_spans],
                       [j for log in logs for j in log.joins])
    requests = sum(log.requests for log in logs)
    tokens = sum(log.tokens for log in logs)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)

    peak = None
    for line in metrics.splitlines():
        if line.startswith("sfi_process_peak_rss_bytes "):
            peak = float(line.split()[1])
    return {
        "clients": clients, "mode": body.get("mode", "sfi"), "seconds": round(elapsed, 2),
        "requests": requests, "errors": sum(log.errors for log in logs),
        "requests_per_s": round(requests / elapsed, 3), "tokens_per_s": round(tokens / elapsed, 3),
        "ttft_p50_ms": ms(_percentile(ttft, 0.5)), "ttft_p99_ms": ms(_percentile(ttft, 0.99)),
        "itl_p50_ms": ms(_percentile(gaps, 0.5)), "itl_p99_ms": ms(_percentile(gaps, 0.99)),
        "itl_max_ms": ms(max(gaps)) if gaps else None,
        "join_stall_ms": ms(stall) if gaps else None,
        "itl_mean_ms": ms(statistics.fmean(gaps)) if gaps else None,
        "server_peak_rss_mb": round(peak / 2**20, 1) if peak else None,
        "error_samples": [m for log in logs for m in log.error_messages][:5],
    }


def run_loadtest(url: str, clients: int, duration: float, max_tokens: int, mode: str,
                 prompt_chars: int | list[int], model: str = "default",
                 api_key: str | None = None) -> dict[str, Any]:
    """Drive ``url`` with ``clients`` concurrent streaming clients for ``duration`` seconds.

    ``prompt_chars``: the prompts' length in characters, or several lengths (client i sends
    prompts of the (i mod n)-th length, so short and long requests mix)."""
    from sfi.texts import essays

    text = essays()
    lengths = [prompt_chars] if isinstance(prompt_chars, int) else list(prompt_chars)
    prompts = []
    for chars in lengths:
        step = max(1, (len(text) - chars) // 64)
        prompts.append([text[i * step: i * step + chars] for i in range(64)])
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "mode": mode}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = asyncio.run(_run(url.rstrip("/"), clients, duration, body, prompts, headers))
    return {**result, "prompt_chars": lengths}

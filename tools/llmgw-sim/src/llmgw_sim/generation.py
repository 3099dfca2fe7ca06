"""Chat and text completions: admission, simulated prefill and decode (timed, or by the step
scheduler), statistics, and the full or streamed (SSE) answer."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec

from llmgw_sim import bootstrap, kvtransfer
from llmgw_sim.driver import Waiter
from llmgw_sim.handlers import Handlers
from llmgw_sim.httpserver import Request, Response, Stream
from llmgw_sim.kvtransfer import wants_remote_decode, wants_remote_prefill
from llmgw_sim.model import echo_tokens, greedy_tokens, output_length, tokenize
from llmgw_sim.protocol import Generation, parse_chat, parse_completion
from llmgw_sim.scheduler import Seq, block_hashes

STALL_HEADER = "X-Sim-Stall-After"
# Request header names arrive lower-cased.
_STALL_KEY = STALL_HEADER.lower()

_enc = msgspec.json.encode
_JSON = "application/json"


class GenerationRoutes(Handlers):
    """/v1/chat/completions and /v1/completions (and llama-server's unversioned paths)."""

    async def chat(self, request: Request) -> Response | Stream:
        return await self._generate(request, self._parse_chat)

    async def completions(self, request: Request) -> Response | Stream:
        return await self._generate(request, self._parse_completion)

    def _parse_chat(self, body: dict[str, Any]) -> Generation:
        gen = parse_chat(body, prefill_assistant=self.engine.kind == "llama-server")
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            ids = tokenizer.chat(body.get("messages"))
            if ids:
                gen = dataclasses.replace(gen, prompt_ids=list(ids))
        return gen

    def _parse_completion(self, body: dict[str, Any]) -> Generation:
        gen = parse_completion(body)
        tokenizer = self.engine.tokenizer
        if tokenizer is not None and gen.prompt_ids is None:
            ids = tokenizer.completion(gen.prompt_text)
            if ids:
                gen = dataclasses.replace(gen, prompt_ids=list(ids))
        return gen

    async def _generate(
        self, request: Request, parse: Callable[[dict[str, Any]], Generation]
    ) -> Response | Stream:
        """One generation; an SGLang prefill engine's room (llmgw_sim.bootstrap) is done
        when it answered 200 (its prefill computed), failed otherwise."""
        announced: list[int] = []
        ok = False
        try:
            resp = await self._generate_one(request, parse, announced)
            ok = isinstance(resp, Stream) or resp.status == 200  # a stream: prefill done
            return resp
        finally:
            for room in announced:
                self.engine.rooms.finish(room, ok)

    async def _sglang_rooms(
        self, room: tuple[str, int, int] | str | None, prompt_len: int, announced: list[int]
    ) -> Response | float | None:
        """SGLang's disaggregation: a prefill engine announces the room; a decode engine
        waits for it (the transfer's seconds), or refuses the request (a Response)."""
        eng = self.engine
        mode = eng.config.disaggregation_mode
        if isinstance(room, str):
            return eng.error(400, room)
        if mode == "prefill" and room is not None:
            eng.rooms.announce(room[2], prompt_len)
            announced.append(room[2])
        elif mode == "decode":
            if room is None:
                return eng.error(
                    400,
                    "this engine runs --disaggregation-mode decode: a request needs "
                    "bootstrap_host, bootstrap_port and bootstrap_room",
                )
            why = await bootstrap.await_room(*room, prompt_len, eng.knobs.bootstrap_timeout)
            if why is not None:
                eng.kv_counts["kv_refused"] += 1
                return eng.error(500, why)
            eng.kv_counts["kv_received"] += 1
            return eng.knobs.kv_transfer_per_token * prompt_len
        return None

    async def _generate_one(
        self,
        request: Request,
        parse: Callable[[dict[str, Any]], Generation],
        announced: list[int],
    ) -> Response | Stream:
        eng = self.engine
        arrival = time.monotonic()
        kv_seen: list[Any] = []
        rooms_seen: list[tuple[str, int, int] | str | None] = []
        lora_seen: list[object] = []

        def parse_kv(body: dict[str, Any]) -> Generation:
            kv_seen.append(body.get("kv_transfer_params"))
            rooms_seen.append(bootstrap.room_fields(body))
            lora_seen.append(body.get("lora_path"))
            return parse(body)

        gen = self._admit(request, parse_kv)
        if isinstance(gen, Response):
            return gen
        adapter = eng.adapter_for(gen.model, lora_seen[0] if lora_seen else None)
        if isinstance(adapter, Response):
            return adapter
        gen = dataclasses.replace(gen, adapter=adapter)
        kv = kv_seen[0] if kv_seen else None
        cap = eng.token_cap
        prompt: list[Any] = (
            gen.prompt_ids if gen.prompt_ids is not None else tokenize(gen.prompt_text, cap)
        )
        prompt_len = len(prompt)
        bad = eng.context_error(gen, prompt_len, at_least=prompt_len >= cap)
        if bad is not None:
            return bad
        transfer: float | None = None
        if isinstance(kv, dict) and wants_remote_prefill(kv):
            why = kvtransfer.verify(kv, prompt_len)
            if why is not None:
                eng.kv_counts["kv_refused"] += 1
                return eng.error(400, why)
            eng.kv_counts["kv_received"] += 1
            transfer = eng.knobs.kv_transfer_per_token * prompt_len
        if eng.config.kind == "sglang" and eng.config.disaggregation_mode != "null":
            got = await self._sglang_rooms(
                rooms_seen[0] if rooms_seen else None, prompt_len, announced
            )
            if isinstance(got, Response):
                return got
            if got is not None:
                transfer = got
        stall_after = eng.knobs.stall_after_tokens
        stall_raw = request.headers.get(_STALL_KEY)
        if stall_raw is not None:
            try:
                stall_after = int(stall_raw)
            except ValueError:
                return eng.error(400, f"{STALL_HEADER} must be an integer, got {stall_raw!r}")
        knobs = eng.knobs
        count, finish = output_length(
            requested_max=gen.max_tokens,
            sim_output_len=knobs.output_len,
            default_max_tokens=knobs.default_max_tokens,
            prompt_tokens=prompt_len,
            max_model_len=eng.config.max_model_len,
            ignore_eos=gen.ignore_eos,
        )
        if knobs.mode == "echo":
            out_tokens = echo_tokens([str(t) for t in prompt], count)
        else:
            # Greedy: the text is a function of the prompt (and seeds), token by token, so
            # a prompt that ends with the first k tokens of an answer continues it exactly.
            context = gen.prompt_text or " ".join(map(str, gen.prompt_ids or ()))
            # An adapter answers differently from the base model and from other adapters.
            seed = (
                knobs.seed
                ^ (gen.seed or 0)
                ^ (zlib.crc32(gen.adapter.encode()) if gen.adapter else 0)
            )
            out_tokens = greedy_tokens(context, count, seed)

        if eng.driver is not None:
            stepped = await self._generate_stepped(
                request, gen, prompt, out_tokens, finish, stall_after, arrival, transfer
            )
            if wants_remote_decode(kv) and isinstance(stepped, Response) and stepped.status == 200:
                stepped = self._issue_transfer(stepped, prompt_len)
            return stepped
        lora = gen.adapter
        if lora is not None:
            _bump(eng.lora_waiting, lora, 1)
        try:
            rid = await eng.acquire()
        finally:
            if lora is not None:
                _bump(eng.lora_waiting, lora, -1)
        if lora is not None:
            _bump(eng.lora_running, lora, 1)
        started = time.monotonic()
        kv_held = prompt_len
        eng.kv_tokens_in_use += kv_held
        stats = eng.stats
        try:
            cached, hashes = eng.cache.lookup(prompt)
            # A decode engine fetches the prompt's KV cache instead of computing it.
            delay = eng.prefill_delay(prompt_len, cached) if transfer is None else transfer
            if delay > 0:
                await asyncio.sleep(delay)
            eng.cache.insert(hashes)
            first_token_at = time.monotonic()
            self._observe_first(arrival, started, first_token_at, prompt_len)
            eng.kv_tokens_in_use += count
            kv_held += count
            headers = self._id_headers(request)
            if gen.stream:
                resp = await self._stream(
                    request, gen, out_tokens, finish, prompt_len, stall_after, headers
                )
            else:
                decode = eng.decode_delay(count)
                if decode > 0:
                    await asyncio.sleep(decode)
                resp = self._full(gen, out_tokens, finish, prompt_len, headers)
                if wants_remote_decode(kv):
                    resp = self._issue_transfer(resp, prompt_len)
            stats.decode_steps += count
            self._observe(gen, arrival, started, first_token_at, prompt_len, count)
            eng.finished(finish)
        except asyncio.CancelledError:
            # The client went away (or shutdown ran out of grace).
            eng.stats.requests_ok["abort"] += 1
            raise
        finally:
            eng.kv_tokens_in_use -= kv_held
            eng.release(rid)
            if lora is not None:
                _bump(eng.lora_running, lora, -1)
        self._crash_if_due(request, resp)
        return resp

    def _issue_transfer(self, resp: Response, prompt_len: int) -> Response:
        """A prefill for a remote decode: the answer carries the params a decode engine
        needs, at the NIXL side channel the agent gave (VLLM_NIXL_SIDE_CHANNEL_*)."""
        eng = self.engine
        body = msgspec.json.decode(resp.body)
        body["kv_transfer_params"] = kvtransfer.issue(
            eng.knobs.name or f"sim-{os.getpid()}",
            str(body.get("id", "")),
            prompt_len,
            os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
            int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600") or 5600),
        )
        eng.kv_counts["kv_issued"] += 1
        return Response(resp.status, _enc(body), _JSON, resp.headers)

    def _crash_if_due(self, request: Request, resp: Response | Stream) -> None:
        eng = self.engine
        if eng.crash_due():
            # Deliver this response completely, then die as the engine would.
            if isinstance(resp, Response):
                conn = request.conn
                head = conn.server.head(resp.status, resp.headers, len(resp.body), False)
                conn.write(head + resp.body)
            eng.crash(f"after {eng.completed} requests")

    def _id_headers(self, request: Request) -> dict[str, str] | None:
        if not self.engine.config.request_id_headers:
            return None
        return {"X-Request-Id": request.headers.get("x-request-id") or self.engine.new_id("")}

    def _observe_first(
        self, arrival: float, started: float, first_token_at: float, prompt_len: int
    ) -> None:
        stats = self.engine.stats
        stats.ttft.observe(first_token_at - arrival)
        stats.prompt_tokens += prompt_len
        stats.prompt_seconds += first_token_at - started

    def _observe(
        self,
        gen: Generation,
        arrival: float,
        started: float,
        first_token_at: float,
        prompt_len: int,
        count: int,
    ) -> None:
        stats = self.engine.stats
        done = time.monotonic()
        stats.generation_tokens += count
        stats.decode_seconds += done - first_token_at
        if count > 1:
            per_token = (done - first_token_at) / (count - 1)
            stats.itl.observe_many(per_token, count - 1)
            stats.tpot.observe(per_token)
        stats.e2e.observe(done - arrival)
        stats.queue_time.observe(started - arrival)
        stats.prefill_time.observe(first_token_at - started)
        stats.decode_time.observe(done - first_token_at)
        stats.inference_time.observe(done - started)
        stats.prompt_len.observe(prompt_len)
        stats.gen_len.observe(count)
        if gen.max_tokens is not None:
            stats.max_tokens_param.observe(gen.max_tokens)

    async def _generate_stepped(
        self,
        request: Request,
        gen: Generation,
        prompt: list[Any],
        out_tokens: list[str],
        finish: str,
        stall_after: int | None,
        arrival: float,
        transfer: float | None = None,
    ) -> Response | Stream:
        """The step scheduler's path: queue in the engine, wait for its steps.

        ``transfer``: a decode of a prefill engine's KV cache, fetched for that many seconds
        first; the scheduler then computes only the prompt's last token (Seq.remote_kv).
        """
        eng = self.engine
        driver = eng.driver
        assert driver is not None
        sched = driver.scheduler
        prompt_len, count = len(prompt), len(out_tokens)
        if not sched.fits(prompt_len, count):
            cfg = eng.config
            return eng.error(
                400,
                f"The request needs {prompt_len + count} tokens of KV cache; the cache holds "
                f"{sched.config.num_blocks * cfg.block_size} tokens.",
            )
        eng._next_rid += 1
        rid = eng._next_rid
        hashes = (
            block_hashes([str(t) for t in prompt], eng.config.block_size)
            if eng.config.prefix_caching
            else []
        )
        ids = gen.prompt_ids if eng.tokenizer is not None else None
        if transfer:
            await asyncio.sleep(transfer)
        waiter = driver.submit(
            Seq(
                rid,
                prompt_len,
                count,
                hashes,
                token_ids=ids,
                lora=gen.adapter,
                remote_kv=transfer is not None,
            ),
            stream=gen.stream,
        )
        try:
            while waiter.first_at is None and not waiter.done:
                waiter.event.clear()
                await waiter.event.wait()
            first_token_at = waiter.first_at or time.monotonic()
            started = waiter.admitted_at or first_token_at
            self._observe_first(arrival, started, first_token_at, prompt_len)
            headers = self._id_headers(request)
            resp: Response | Stream
            if gen.stream:
                resp = await self._stream(
                    request, gen, out_tokens, finish, prompt_len, stall_after, headers, waiter
                )
            else:
                while not waiter.done:
                    waiter.event.clear()
                    await waiter.event.wait()
                resp = self._full(gen, out_tokens, finish, prompt_len, headers)
            self._observe(gen, arrival, started, first_token_at, prompt_len, count)
            eng.finished(finish)
        except asyncio.CancelledError:
            eng.stats.requests_ok["abort"] += 1
            raise
        finally:
            driver.abort(rid)  # frees its blocks when it did not finish (client gone)
        self._crash_if_due(request, resp)
        return resp

    def _full(
        self,
        gen: Generation,
        tokens: list[str],
        finish: str,
        prompt_len: int,
        headers: dict[str, str] | None,
    ) -> Response:
        eng = self.engine
        text = "".join(tokens)
        usage = {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + len(tokens),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": None,
        }
        created = int(time.time())
        body: dict[str, Any]
        if gen.endpoint == "chat":
            body = {
                "id": eng.new_id("chatcmpl-"),
                "object": "chat.completion",
                "created": created,
                "model": gen.model or eng.config.primary_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": eng.new_id("cmpl-"),
                "object": "text_completion",
                "created": created,
                "model": gen.model or eng.config.primary_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        return Response(body=_enc(body), content_type=_JSON, headers=headers)

    async def _stream(
        self,
        request: Request,
        gen: Generation,
        tokens: list[str],
        finish: str,
        prompt_len: int,
        stall_after: int | None,
        headers: dict[str, str] | None,
        waiter: Waiter | None = None,
    ) -> Response | Stream:
        """Write the SSE stream: paced by --sim-itl, or by the engine's steps (``waiter``)."""
        eng = self.engine
        chat = gen.endpoint == "chat"
        rid = eng.new_id("chatcmpl-" if chat else "cmpl-")
        model = _enc(gen.model or eng.config.primary_name)
        created = int(time.time())
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        head = b'data: {"id":"%s","object":"%s","created":%d,"model":%s,"choices":[' % (
            rid.encode(),
            obj,
            created,
            model,
        )
        if chat:
            open_ = head + b'{"index":0,"delta":{"content":'
            mid = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            end = (
                b'},"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n'
                % finish.encode()
            )
        else:
            open_ = head + b'{"index":0,"text":'
            mid = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            end = (
                b',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
            )

        # vLLM adds running usage to every chunk only with both stream options.
        continuous = gen.include_usage and gen.continuous_usage
        n = len(tokens)
        itl = eng.timing.itl
        limit = n if stall_after is None else min(n, max(0, stall_after))
        chunked = bool(n and (itl > 0 or waiter is not None or limit < n or continuous))
        # A stream written in one piece may send its headers with the body (one
        # write instead of two); a paced one shows its headers at once.
        resp = Stream(request)
        resp.prepare(
            200,
            {
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **(headers or {}),
            },
            send_now=chunked,
        )

        def with_usage(chunk: bytes, done: int) -> bytes:
            if not continuous:
                return chunk
            usage = b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
                prompt_len,
                prompt_len + done,
                done,
            )
            return chunk[:-3] + b"," + usage + b"}\n\n"

        parts: list[bytes] = []
        if chat:
            parts.append(
                with_usage(
                    head + b'{"index":0,"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}]}\n\n',
                    0,
                )
            )
        encoded = [_token_json(t) for t in tokens] or [b'""']
        if chunked:
            # Paced, stalling or per-chunk usage: chunk by chunk.
            for i in range(limit):
                parts.append(with_usage(open_ + encoded[i] + (end if i == n - 1 else mid), i + 1))
                if waiter is not None:
                    if i < n - 1 and waiter.tokens <= i + 1:
                        # Everything sampled so far goes out in one write; then wait a step.
                        await resp.write(b"".join(parts))
                        parts.clear()
                        while waiter.tokens <= i + 1 and not waiter.done:
                            waiter.event.clear()
                            await waiter.event.wait()
                elif itl > 0:
                    await resp.write(b"".join(parts))
                    parts.clear()
                    if i < n - 1:
                        await asyncio.sleep(eng.token_delay())
            if limit < n:
                if parts:
                    await resp.write(b"".join(parts))
                # Stalled: the connection stays open and silent until the client
                # gives up or shutdown cancels us.
                await asyncio.Event().wait()
        else:
            # No pacing: every event at once, built by one C-level join.
            parts.append(with_usage(open_ + (mid + open_).join(encoded) + end, n))
        if gen.include_usage:
            parts.append(
                head[: -len(b'"choices":[')]
                + b'"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,'
                b'"completion_tokens":%d}}\n\n' % (prompt_len, prompt_len + n, n)
            )
        parts.append(b"data: [DONE]\n\n")
        await resp.write_eof(b"".join(parts))
        return resp


def _bump(counts: dict[str, int], key: str, delta: int) -> None:
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


_TOKEN_JSON: dict[str, bytes] = {}


def _token_json(token: str) -> bytes:
    """JSON for a token, cached: generated text reuses a small vocabulary."""
    cached = _TOKEN_JSON.get(token)
    if cached is None:
        cached = _enc(token)
        if len(_TOKEN_JSON) < 65536:
            _TOKEN_JSON[token] = cached
    return cached

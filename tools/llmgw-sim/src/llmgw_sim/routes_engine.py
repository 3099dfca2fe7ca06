"""The routes only some engine kinds serve: vLLM's version, runtime LoRA and tokenizer
endpoints, SGLang's model and server info, llama-server's /props."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from llmgw_sim.handlers import Handlers
from llmgw_sim.httpserver import Request, Response
from llmgw_sim.model import tokenize
from llmgw_sim.protocol import BadRequest, decode_body, parse_tokenize

_enc = msgspec.json.encode


async def _loading(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


_JSON = "application/json"


class VllmRoutes(Handlers):
    """/version (SGLang's too), /v1/load_lora_adapter, /v1/unload_lora_adapter, /tokenize,
    /detokenize."""

    async def version(self, request: Request) -> Response:
        return Response(body=_enc({"version": self.engine.config.version}), content_type=_JSON)

    # ----- vLLM's runtime LoRA endpoints ------------------------------------

    async def load_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return eng.error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in eng.loras:
            return eng.error(400, f"The lora adapter '{name}' has already been loaded.")
        # Reading the adapter's weights takes time (--sim-lora-load-time).
        await _loading(eng.config.knobs.lora_load_time)
        eng.loras[name] = path
        return Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in eng.loras:
            return eng.error(404, f"The lora adapter '{name}' cannot be found.")
        del eng.loras[name]
        return Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ----- vLLM's tokenizer endpoints ---------------------------------------

    # Outside /v1, so vLLM's --api-key does not cover them.
    async def tokenize(self, request: Request) -> Response:
        eng = self.engine
        try:
            model, prompt = parse_tokenize(decode_body(request.body))
        except BadRequest as err:
            return eng.error(400, str(err))
        bad = eng.check_model(model)
        if bad is not None:
            return bad
        ids = (
            prompt
            if isinstance(prompt, list)
            else eng.vocab.encode(tokenize(prompt, eng.token_cap))
        )
        body = {
            "count": len(ids),
            "max_model_len": eng.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return Response(body=_enc(body), content_type=_JSON)

    async def detokenize(self, request: Request) -> Response:
        eng = self.engine
        try:
            body = decode_body(request.body)
        except BadRequest as err:
            return eng.error(400, str(err))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            return eng.error(400, "'tokens' must be a list of token ids")
        return Response(body=_enc({"prompt": eng.vocab.decode(ids)}), content_type=_JSON)


class SglangRoutes(Handlers):
    """/get_model_info, /get_server_info, /load_lora_adapter, /unload_lora_adapter."""

    def _lora_answer(self, error: str = "") -> Response:
        # SGLang answers LoadLoRAAdapterReqOutput: success, error_message, loaded_adapters.
        body = {
            "success": not error,
            "error_message": error,
            "loaded_adapters": dict(self.engine.loras),
        }
        return Response(status=400 if error else 200, body=_enc(body), content_type=_JSON)

    async def load_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return self._lora_answer("lora_name and lora_path are required")
        if name in eng.loras:
            return self._lora_answer(f"LoRA adapter {name} is already loaded.")
        await _loading(eng.config.knobs.lora_load_time)
        eng.loras[name] = path
        return self._lora_answer()

    async def unload_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in eng.loras:
            return self._lora_answer(f"LoRA adapter {name} is not loaded.")
        del eng.loras[name]
        return self._lora_answer()

    async def model_info(self, request: Request) -> Response:
        cfg = self.engine.config
        return Response(
            body=_enc(
                {
                    "model_path": cfg.model,
                    "tokenizer_path": cfg.model,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                }
            ),
            content_type=_JSON,
        )

    async def server_info(self, request: Request) -> Response:
        cfg = self.engine.config
        info: dict[str, Any] = {
            "model_path": cfg.model,
            "served_model_name": cfg.primary_name,
            "tp_size": cfg.tp,
            "dp_size": cfg.dp,
            "context_length": cfg.max_model_len,
            "max_running_requests": cfg.max_num_seqs,
            "port": cfg.port,
            "host": cfg.host,
            "version": cfg.version,
        }
        return Response(body=_enc(info), content_type=_JSON)


class LlamaRoutes(Handlers):
    """/props."""

    async def props(self, request: Request) -> Response:
        if not self.engine.ready:
            return self.engine.loading_response()
        cfg = self.engine.config
        body = {
            "default_generation_settings": {"n_ctx": cfg.max_model_len, "params": {}},
            "total_slots": cfg.max_num_seqs,
            "model_path": cfg.model,
            "model_alias": cfg.primary_name,
            "build_info": f"b{cfg.version.lstrip('b')}-llmgwsim",
            "chat_template": "",
        }
        return Response(body=_enc(body), content_type=_JSON)

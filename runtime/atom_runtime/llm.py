"""The offline API, shaped like vLLM's so users' scripts carry over:

from atom_runtime import LLM, SamplingParams
llm = LLM(model="path/to/model")
for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
    print(out.outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from atom_runtime.config import EngineConfig
from atom_runtime.engine.core import EngineCore
from atom_runtime.engine.output_processor import OutputProcessor, RequestOutput
from atom_runtime.models.source import resolve_model_path
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.system.process import ensure_logging
from atom_runtime.text.tokenizer import Tokenizer

PromptType = str | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`kwargs`: EngineConfig's fields (vLLM's names: dtype, max_num_seqs, tokenizer,
        tensor_parallel_size, ...). Loading shows a progress bar and logs its phases."""
        ensure_logging()
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = EngineCore(self.config)
        tokenizer_path = self.engine.model_path
        if self.config.tokenizer is not None:
            c = self.config
            tokenizer_path = resolve_model_path(c.tokenizer, c.revision, c.download_dir)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer.from_path(
                tokenizer_path, self.engine.eos_token_ids
            )
        except FileNotFoundError:
            # A bare config.json (dummy weights for benchmarks): token-id prompts only.
            self.tokenizer = None
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _require_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass prompt_token_ids")
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; a prompt is a string or {"prompt_token_ids": [...]}.
        Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            text, token_ids = self._tokenize(prompt)
            ids.append(self._submit(text, token_ids, p))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = sampling_params or SamplingParams()
        ids = []
        for conv in conversations:
            token_ids = self._require_tokenizer("messages").encode_chat(conv, **template_kwargs)
            ids.append(self._submit(None, token_ids, params))
        return self._run(ids, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer("prompt").encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self._require_tokenizer("prompt").encode(prompt["prompt"])
        raise ValueError("prompt: must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _submit(self, text: str | None, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        for req in self.processor.add_request(request_id, text, token_ids, params):
            try:
                self.engine.add_request(req)
            except ValueError:
                self.engine.abort_requests(self.processor.abort(request_id))
                raise
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids), desc="generating", disable=not use_tqdm or len(request_ids) < 2
        )
        try:
            while len(results) < len(request_ids):
                updated, to_abort = self.processor.process(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for state in updated:
                    if state.finished:
                        results[state.request_id] = state.output()
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(request_ids):
                    raise RuntimeError("engine went idle with requests unfinished")
            ck = self.engine.checkpoints
            if ck is not None and ck.maint.needs_flush:
                # A checkpoint copy queued for a request that just ended (its answer's last
                # decode anchor): one more step runs it, so the engine is idle and the next
                # call finds the checkpoint READY.
                self.engine.step()
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

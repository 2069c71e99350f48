"""The offline Python API, shaped like vLLM's ``LLM``.

    llm = LLM("path/to/model")                # no argument: the built-in default model
    outs = llm.chat(conversations, SamplingParams(max_tokens=32, temperature=0.0))
    outs[i].token_ids, outs[i].text, outs[i].finish_reason
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from hydrad.chat_options import ChatTemplateOptions
from hydrad.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from hydrad.detokenizer import IncrementalDetokenizer
from hydrad.engine.inputs import EngineRequest, TokenLogprobs
from hydrad.errors import ConfigError
from hydrad.sampling_params import SamplingParams, split_choices


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # One entry per token, when SamplingParams.logprobs is set.
    logprobs: list[TokenLogprobs] | None = None
    stage_times: dict[str, float] | None = None
    # Prompt tokens found in the prefix cache (their prefill skipped).
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, one entry per prompt token, as vLLM gives them: None
    # for the first (nothing predicts it), then each token's given the ones before it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestOutput:
    """A request's result; ``token_ids``, ``text``, ``finish_reason`` and ``logprobs`` are its
    first completion's, ``outputs`` holds all ``n``."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_images: int = 0
    stage_times: dict[str, float] | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Prompt tokens found in the prefix cache (the first completion's).
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs (``CompletionOutput.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs) if self.outputs else \
            self.finish_reason is not None


class LLM:
    """Offline inference over one deployment of instances.

    ``deploy="1EPD"`` on ``devices="cpu:1"`` (the default) runs one engine in this
    process. Any other deployment (``1E+1P+1D``, ``1EP+1D``, ``2EPD``, ...) runs one
    worker process per device, as the daemon does, with stages migrating between them;
    ``worker_processes=False`` runs those instances in this process instead, taking turns
    (same engines, same migration protocol; useful to step and inspect them).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        deploy: str = "1EPD",
        devices: str = "cpu:1",
        dtype: str = "auto",
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        kv_block_size: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_mb: int | None = None,
        image_block_size: int | None = None,
        num_image_blocks: int | None = None,
        image_cache_memory_mb: int | None = None,
        gpu_memory_utilization: float = 0.9,
        prefix_caching: bool = True,
        token_budget: int = 2048,
        image_budget: int = 4,
        max_num_seqs: int = 256,
        max_images_per_request: int = 8,
        max_video_frames: int = 32,
        dual_streams: bool | str = "auto",
        router_policy: str = "round-robin",
        worker_processes: bool = True,
        seed: int = 0,
        chat_template: str | None = None,
    ):
        import torch

        from hydrad.engine.core import EngineCore
        from hydrad.models.default import resolve_model_path
        from hydrad.processor import InputProcessor
        from hydrad.cluster.deploy import plan_instances

        num_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        instances = plan_instances(deploy, devices, num_cuda)
        model_path = resolve_model_path(model)
        self.config = EngineConfig(
            model=ModelConfig(path=str(model_path), dtype=dtype, max_model_len=max_model_len,
                              attention_backend=attention_backend, chat_template=chat_template),
            cache=CacheConfig(
                kv_block_size=kv_block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_mb=kv_cache_memory_mb,
                image_block_size=image_block_size,
                num_image_blocks=num_image_blocks,
                image_cache_memory_mb=image_cache_memory_mb,
                gpu_memory_utilization=gpu_memory_utilization,
                prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(
                token_budget=token_budget, image_budget=image_budget, max_num_seqs=max_num_seqs, derive_budgets=False
            ),
            parallel=ParallelConfig(deploy=deploy, devices=devices, dual_streams=dual_streams),
            seed=seed,
        )
        roles = [role for role, _ in instances]
        device = instances[0][1]
        if roles == ["EPD"]:
            self.engine = EngineCore(self.config, role="EPD", device=device)
        elif worker_processes:
            from hydrad.cluster.process import ProcessCluster
            from hydrad.console import console

            self.engine = ProcessCluster(self.config, instances, policy=router_policy, console=console)
        else:
            from hydrad.cluster.local import LocalCluster

            if len({d for _, d in instances}) > 1:
                raise ConfigError("worker_processes=False runs every instance on one device")
            self.engine = LocalCluster(self.config, roles, device=device, policy=router_policy)
        self.processor = InputProcessor(
            model_path, max_images_per_request=max_images_per_request, max_model_len=self.engine.max_model_len,
            max_video_frames=max_video_frames, chat_template=chat_template,
        )
        self._ids = itertools.count()

    # -- public API ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the worker processes (if any) and the engine's threads."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Run one conversation (a list of messages) or many (a list of such lists).
        ``tools`` (the chat API's) go to the chat template; the calls a model writes are in
        its text (``hydrad.tool_calls.read_answer`` reads Hermes' format). The template's
        options as vLLM's ``LLM.chat`` takes them (``hydrad.chat_options``): with
        ``continue_final_message`` (and ``add_generation_prompt`` false) the model continues
        the last message, an assistant's; ``chat_template_kwargs`` are the template's own
        variables."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = ChatTemplateOptions.of(add_generation_prompt, continue_final_message, chat_template_kwargs)
        prompts = [self.processor.process_chat(conv, tools, options) for conv in conversations]
        return self._run(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Prompts without a chat template: each a text, or as vLLM takes them, a dict with
        ``"prompt"`` (a text) or ``"prompt_token_ids"`` (token ids, taken as they are)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
        return self._run([self.processor.process_prompt(_prompt_of(p)) for p in prompts], sampling_params,
                         use_tqdm)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        outputs: list[RequestOutput] = []
        # Engine request id -> (the completion it fills, its detokenizer); n > 1 runs n requests.
        completions: dict[str, tuple[CompletionOutput, IncrementalDetokenizer]] = {}
        requests: list[EngineRequest] = []
        for prompt, p in zip(prompts, params):
            req_id = f"llm-{next(self._ids)}"
            out = RequestOutput(req_id, prompt.prompt_token_ids, num_images=len(prompt.images))
            for i, child in enumerate(split_choices(p, price_once=True)):
                request = self.processor.make_engine_request(f"{req_id}-{i}" if p.n > 1 else req_id, prompt, child,
                                                             f"{req_id}-0" if p.n > 1 else None)
                completion = CompletionOutput(i, logprobs=[] if child.logprobs is not None else None)
                out.outputs.append(completion)
                completions[request.req_id] = (completion, IncrementalDetokenizer(self.processor.tokenizer, child))
                requests.append(request)
            outputs.append(out)
        try:
            for r in requests:
                self.engine.add_request(r)
        except Exception:
            self.engine.abort_requests(completions)
            raise
        progress = _Progress(len(requests)) if use_tqdm else None
        unfinished = set(completions)
        try:
            while unfinished:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped {len(unfinished)} request(s) without finishing them")
                step = self.engine.step()
                for i, (req_id, token_id) in enumerate(zip(step.req_ids, step.token_ids)):
                    if req_id not in unfinished:
                        continue
                    completion, detok = completions[req_id]
                    completion.token_ids.append(token_id)
                    entry = step.logprobs[i] if step.logprobs is not None else None
                    if entry is not None and entry.prompt is not None:
                        completion.prompt_logprobs = [None, *entry.prompt.entries]
                    if completion.logprobs is not None and entry is not None:
                        completion.logprobs.append(entry)
                    detok.add_tokens([token_id])
                    if detok.stopped:
                        self.engine.abort_requests([req_id])
                        self._finish(req_id, completion, detok, "stop", None, unfinished, progress)
                for finished in step.finished:
                    if finished.req_id in unfinished:
                        completion, detok = completions[finished.req_id]
                        completion.num_cached_tokens = finished.num_cached_tokens
                        self._finish(finished.req_id, completion, detok, finished.finish_reason,
                                     finished.stage_times, unfinished, progress)
        finally:
            self.engine.abort_requests(unfinished)
            if progress:
                progress.close()
        for out in outputs:
            first = out.outputs[0]
            for other in out.outputs[1:]:  # the prompt was priced once, by the first completion
                if other.prompt_logprobs is None and first.prompt_logprobs is not None:
                    other.prompt_logprobs = list(first.prompt_logprobs)
            out.token_ids, out.text, out.finish_reason = first.token_ids, first.text, first.finish_reason
            out.logprobs, out.stage_times = first.logprobs, first.stage_times
            out.num_cached_tokens, out.prompt_logprobs = first.num_cached_tokens, first.prompt_logprobs
        return outputs

    @staticmethod
    def _finish(req_id, completion: CompletionOutput, detok: IncrementalDetokenizer, reason: str, stage_times,
                unfinished: set, progress) -> None:
        completion.finish_reason = reason
        completion.stage_times = stage_times
        detok.flush()
        completion.text = detok.text
        unfinished.discard(req_id)
        if progress:
            progress.advance()


def _prompt_of(prompt: str | dict) -> str | list[int]:
    """A prompt of ``LLM.generate`` as the Request Processor takes it."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and len(prompt) == 1:
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        token_ids = prompt.get("prompt_token_ids")
        if isinstance(token_ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in token_ids):
            return list(token_ids)
    raise ValueError(f"a prompt must be a text, {{'prompt': text}} or {{'prompt_token_ids': [ids]}}; "
                     f"got {prompt!r:.80}")


class _Progress:
    """Requests finished out of submitted, on the terminal."""

    def __init__(self, total: int):
        from rich.progress import Progress

        from hydrad.console import console

        # Off a terminal a transient display would leave only an empty line behind.
        self._p = Progress(console=console, transient=True, disable=not console.is_terminal)
        self._p.start()
        self._task = self._p.add_task("requests", total=total)

    def advance(self) -> None:
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()

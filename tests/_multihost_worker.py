"""Multi-host decoding on one machine: 2 processes x 4 CPU devices joined by jax.distributed.

    python tests/_multihost_worker.py --launch        # starts both processes, prints RESULT {"ok": ...}

Each process calls jax.distributed.initialize before any other jax call, builds the same 8-device mesh over
jax.devices() (both processes' devices), loads the same model and runs the same generate(); its weights are
split across the two processes, and the tokens must equal the single-device run. The target has an odd
vocabulary (517, padded) and 2 kv heads (replicated on the model axes of 4 and 8); a chain and a static tree
drafted by a draft model run besides plain decoding. XLA_FLAGS must give each
process 4 CPU devices (tests/test_sharding.py sets it).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

NUM_PROCESSES = 2


def child(port: int, pid: int) -> None:
    import jax
    jax.distributed.initialize(f"localhost:{port}", NUM_PROCESSES, pid)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import specjax
    from tiny import perturbed, ragged_prompts, tiny_model
    from specjax import SpecConfig, layout, sharding

    target = tiny_model(0, vocab=517, hidden=64, heads=8, kv_heads=2)
    near = perturbed(target, 0.02)
    prompts = ragged_prompts(5, vocab=517, seed=5)
    out = {"process": jax.process_index(), "local": jax.local_device_count(), "global": jax.device_count()}
    for method, kw, drafter in [("none", {}, None),
                                ("draft_model", dict(method="draft_model", num_speculative_tokens=3), near),
                                ("tree", dict(method="draft_model", tree_choices=((0,), (1,), (0, 0))), near)]:
        cfg = SpecConfig(max_new_tokens=16, **kw)
        out[f"{method}@single"] = specjax.generate(target, prompts, cfg, drafter=drafter).tokens
        for shape in [(1, 8), (2, 4)]:          # model axis across processes; data axis across processes
            mesh = sharding.make_mesh(*shape)
            out[f"{method}@{shape[0]}x{shape[1]}"] = specjax.generate(target, prompts, cfg, drafter=drafter,
                                                                      mesh=mesh).tokens
    params = sharding.shard_params(target.params, target.config, sharding.make_mesh(1, 8))
    out["local_param_bytes"] = sum(sharding.bytes_per_device(params).values())
    out["device_param_bytes"] = layout.memory_per_device(target.config, 1, 8, dtype_bytes=4).params
    print("CHILD " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def launch() -> None:
    with socket.socket() as s:                    # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(port), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(NUM_PROCESSES)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=840)
        lines = [l for l in stdout.splitlines() if l.startswith("CHILD ")]
        outs.append(json.loads(lines[-1][6:]) if p.returncode == 0 and lines else {"error": stderr[-3000:]})
    ok = all("error" not in o for o in outs)
    if ok:
        keys = [k for k in outs[0] if "@" in k]
        ok = all(o[k] == outs[0][f"{k.split('@')[0]}@single"] == outs[0]["none@single"] for o in outs for k in keys)
        ok = ok and all(o["global"] == 8 and o["local"] == 4 for o in outs)
        # Mesh (1, 8) splits the (padded, kv-replicated) weights over both processes: 4 devices' shares each.
        ok = ok and all(o["local_param_bytes"] == 4 * o["device_param_bytes"] for o in outs)
    print("RESULT " + json.dumps({"ok": ok, "processes": outs}))


if __name__ == "__main__":
    if sys.argv[1] == "--launch":
        launch()
    else:
        child(int(sys.argv[2]), int(sys.argv[3]))
